"""What happens to checkpoints on this node after they are saved or received: the lifecycle
policy above the passive store.

- ``Pins`` (``replication/core/sink.py``, which transports pin through): steps whose buffers
  someone is reading (a transfer, a persistent write).
- ``RetentionPolicy`` and ``Retention``: which steps to keep (``keep`` per owner, never a
  pinned step, never the newest step replicated everywhere, ...); the store carries a pass out
  (``LocalStore.apply_retention``: a pure plan, then retiring its shards).
- ``BufferWarmer``: makes the buffers of an owner's next checkpoints ahead of time.
- ``Lifecycle``: the three together for one rank; it subscribes to the receive sink's
  ``ReplicaReceived`` events (a listener thread publishes them). Saves subscribe to nothing:
  the ``Saver`` holds its ``Retention`` and ``BufferWarmer`` and calls them itself, once per
  committed save (``Saver._publish``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from .errors import MLCheckpointError
from .replication.core.sink import Pins, ReplicaReceived
from .replication.schedule.status import Protection
from .store import LocalStore

log = logging.getLogger(__name__)


@dataclass
class RetentionPolicy:
    """Keep ``keep`` complete steps per owner, never a pinned step, never the newest step
    replicated everywhere until a newer one is, never the step being replicated now (so its
    shards are here when the partner's replicas of it arrive), and never the newest step held
    whole here (``store.retention.plan_retention``)."""

    keep: int
    pins: Pins
    replicas: Protection | None = None

    def protected(self, store: LocalStore, *, ask: bool = True) -> set[int]:
        """Steps retention must keep. ``ask=False`` uses the last known protected step rather
        than asking the job-wide counters (a listener thread). That value may be stale, i.e.
        older: it then guards an older step and leaves the newest protected one to the
        next plan that asks; the newest whole step is guarded by every plan regardless."""
        protected = self.pins.steps()
        if self.replicas is not None:
            newest = (self.replicas.newest_protected(store.steps()) if ask
                      else self.replicas.known_protected())
            protected |= {s for s in (newest, self.replicas.round_step()) if s is not None}
        return protected

    def apply(self, store: LocalStore, owners: Iterable[int], *, ask: bool = True) -> list[int]:
        """Retire ``owners``' shards beyond ``keep`` in ``store``; returns the steps retired."""
        return store.apply_retention(owners, self.keep, protected=self.protected(store, ask=ask))


class Retention:
    """A CheckpointManager's retention: its policy over this rank's own shards and, once
    replication runs, the replicas this node keeps for its partners."""

    def __init__(self, store: LocalStore, rank: int, keep: int, pins: Pins):
        self.store = store
        self.policy = RetentionPolicy(keep, pins)
        self.owners = [rank]  # whose shards ``apply`` retires

    def protect_replicas(self, replicas: Protection, partners: Iterable[int]) -> None:
        """Replication started: keep the newest step replicated everywhere, and retire the
        replicas of ``partners`` too."""
        self.policy.replicas = replicas
        self.owners = [self.owners[0], *partners]

    def apply(self) -> list[int]:
        """Retire this rank's shards and the replicas it keeps beyond ``keep``."""
        return self.policy.apply(self.store, self.owners)

    def apply_received(self, owner: int) -> list[int]:
        """A replica of ``owner`` arrived (a listener thread: uses the last known protected
        step rather than asking the c10d store; a stale value only keeps more)."""
        return self.policy.apply(self.store, [owner], ask=False)


class BufferWarmer:
    """Prepares buffers for ``store`` on a background thread, ``keep`` per owner.

    After a save (or a received replica) of ``nbytes``, the next ``keep`` saves of that owner
    need buffers of that size. Making them while training goes on keeps the first saves from
    touching fresh tmpfs pages; once a steady state recycles buffers this does nothing. One
    thread at a time; the work itself is ``LocalStore.prewarm``.
    """

    def __init__(self, store: LocalStore, keep: int):
        self.store = store
        self.keep = keep
        self._lock = threading.Lock()
        self._closed = False
        self.thread: threading.Thread | None = None  # the one preparing now, or the last one
        self._prepared: dict[int, int] = {}  # owner rank -> shard size its buffers were made for

    def prepare(self, owner: int, nbytes: int) -> None:
        """Make ``owner``'s next buffers of ``nbytes`` in the background, unless buffers of that
        size were made already or a preparation is running."""
        with self._lock:
            if (self._closed or nbytes <= 0 or self._prepared.get(owner, -1) >= nbytes
                    or (self.thread is not None and self.thread.is_alive())):
                return
            self._prepared[owner] = nbytes
            self.thread = threading.Thread(target=self._warm, args=(owner, nbytes), daemon=True,
                                           name="mlckpt-prepare")
            self.thread.start()

    def _warm(self, owner: int, nbytes: int) -> None:
        try:
            self.store.prewarm(owner, nbytes, self.keep)
        except (OSError, MLCheckpointError) as e:  # only an optimisation: saves still work
            log.warning("mlcheckpoint: could not prepare buffers for rank %d: %s", owner, e)

    def stop(self) -> None:
        """Start no more preparations."""
        with self._lock:
            self._closed = True

    def close(self, wait: bool) -> bool:
        """Stop; with ``wait``, let a preparation in flight finish. Returns whether none runs."""
        self.stop()
        with self._lock:
            thread = self.thread
        if thread is not None and wait:
            thread.join()
        return thread is None or not thread.is_alive()


class Lifecycle:
    """One rank's lifecycle policy: pins, retention and buffer warming, and what they do when a
    replica arrives (a save calls ``retention`` and ``warmer`` itself, from ``Saver._publish``).

    Subscribe ``replica_received`` to the receive sink (``ReceiveSink(subscribers=...)``): it
    runs on a listener thread, never calls the manager, and touches only the store.
    """

    def __init__(self, store: LocalStore, rank: int, keep: int):
        self.store = store
        self.pins = Pins()  # steps whose buffers a transfer or persistent write reads
        self.retention = Retention(store, rank, keep, self.pins)
        self.warmer = BufferWarmer(store, keep)  # buffers of the next saves

    def replica_received(self, event: ReplicaReceived) -> None:
        """A partner's replica is committed here: retire the owner's old replicas and prepare
        the buffers its next replicas will land in."""
        self.retention.apply_received(event.owner)
        self.warmer.prepare(event.owner, event.nbytes)

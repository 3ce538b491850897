"""What happens to checkpoints on this node after they are saved or received: the lifecycle
policy above the passive store.

- ``Pins`` (``store/pins.py``): steps whose buffers someone is reading (a transfer, a
  persistent write).
- ``Retention`` (``manager/retention.py``: its policy, plan and pass in one module): which steps to
  keep.
- ``BufferWarmer``: makes the buffers of an owner's next checkpoints ahead of time.
- ``Lifecycle``: the three together for one rank. The manager subscribes its
  ``replica_received`` to the receive sink's ``ReplicaReceived`` events (a listener thread
  publishes them); the lifecycle calls nothing of the sink. Saves subscribe to nothing: the
  ``Saver`` holds its ``Retention`` and ``BufferWarmer`` and calls them itself, once per
  committed save (``Saver._publish``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..errors import MLCheckpointError
from ..store import LocalStore
from ..store.pins import Pins
from .retention import Retention

if TYPE_CHECKING:
    from ..replication.core.sink import ReplicaReceived

log = logging.getLogger(__name__)


class BufferWarmer:
    """Prepares buffers for ``store`` on a background thread, ``keep`` per owner.

    After a save (or a received replica) of ``nbytes``, the next ``keep`` saves of that owner
    need buffers of that size. Making them while training goes on keeps the first saves from
    touching fresh tmpfs pages (or page-locking them, for a rank saving from device memory);
    once a steady state recycles buffers this does nothing. One thread at a time works through
    the owners asked for; the work itself is ``BufferPool.prewarm``.
    """

    def __init__(self, store: LocalStore, keep: int):
        self.store = store
        self.keep = keep
        self._lock = threading.Lock()
        self._closed = False
        self.thread: threading.Thread | None = None  # the one preparing now, or the last one
        self._running = False  # a thread works through ``_waiting`` (decided under the lock)
        self._waiting: dict[int, int] = {}  # owner rank -> shard size, not yet started
        self._prepared: dict[int, int] = {}  # owner rank -> shard size its buffers were made for

    def prepare(self, owner: int, nbytes: int) -> None:
        """Make ``owner``'s next buffers of ``nbytes`` in the background, unless buffers of that
        size were made already. A request made while another owner's buffers are being made
        waits its turn (a partner's replica arriving first must not cost a rank its own)."""
        with self._lock:
            if self._closed or nbytes <= 0 or self._prepared.get(owner, -1) >= nbytes:
                return
            self._waiting[owner] = max(nbytes, self._waiting.get(owner, 0))
            if self._running:
                return
            self._running = True
            self.thread = threading.Thread(target=self._work, daemon=True, name="mlckpt-prepare")
            self.thread.start()

    def _work(self) -> None:
        while True:
            with self._lock:
                if self._closed or not self._waiting:
                    self._running = False
                    return
                owner, nbytes = self._waiting.popitem()
                if self._prepared.get(owner, -1) >= nbytes:
                    continue
                self._prepared[owner] = nbytes
            try:
                self.store.pool.prewarm(owner, nbytes, self.keep)
            except (OSError, MLCheckpointError) as e:  # only an optimisation: saves still work
                log.warning("mlcheckpoint: could not prepare buffers for rank %d: %s", owner, e)
            except BaseException:
                with self._lock:  # a later request starts a thread again
                    self._running = False
                raise

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
    ``node_owners``: see ``Retention``.
    """

    def __init__(self, store: LocalStore, rank: int, keep: int,
                 node_owners: Iterable[int] | None = None):
        self.store = store
        self.pins = Pins()  # steps whose buffers a transfer or persistent write reads
        self.retention = Retention(store, rank, keep, self.pins, node_owners)
        self.warmer = BufferWarmer(store, keep)  # buffers of the next saves

    def replica_received(self, event: ReplicaReceived) -> None:
        """A partner's replica is committed here: retire the owner's old replicas and prepare
        the buffers its next replicas will land in."""
        self.retention.apply_received(event.owner)
        self.warmer.prepare(event.owner, event.nbytes)

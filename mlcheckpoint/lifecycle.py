"""BufferWarmer: makes the buffers of an owner's next checkpoints ahead of time.

After a save (or a received replica) of ``nbytes``, the next ``keep`` saves of that owner
need buffers of that size. Making them on a background thread, while training goes on, keeps
the first saves from touching fresh tmpfs pages. Once a steady state recycles buffers this
does nothing. One thread at a time; the work itself is ``LocalStore.prewarm``.
"""

from __future__ import annotations

import logging
import threading

from ..errors import MLCheckpointError
from .local_store import LocalStore

log = logging.getLogger(__name__)


class BufferWarmer:
    """Prepares buffers for ``store`` on a background thread, ``keep`` per owner."""

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

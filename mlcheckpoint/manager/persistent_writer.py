"""PersistentWriter: writes steps to the persistent folder, now or on a thread of its own.

``save(..., persistent=True)`` writes in the caller's thread. ``async_save(...,
persistent=True)`` hands the staged views of the step's tmpfs buffers to ``submit``: the step
stays pinned while the background write reads them, so retention does not recycle its
buffers meanwhile, and is retired once the write ends if it was held past ``keep``.

With ``keep_persistent`` set, rank 0 prunes the folder after each write that succeeded
(``PersistentStorage.prune``), sparing the steps being written.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from .. import history
from .._faults import pause_point
from ..dcp.errors import unwrap_checkpoint_exception
from ..persistent import PersistentOrigin, PersistentStorage
from ..store.identity import Lineage
from ..store.pins import Pins
from .retention import Retention

log = logging.getLogger(__name__)


class PersistentWriter:
    """Writes DCP checkpoints of steps into ``storage``; collective over ``group``.

    Args:
        storage: the persistent folder (never None: without one there is no writer).
        job_dir: the job's tmpfs folder, where history records each write.
        rank: this rank, for history.
        group: the process group of persistent writes (not the in-memory saves' group: the
            two run on different threads and must not interleave their collectives).
        pins: where a background write pins the step it reads.
        retention: applied once a pinned step is released.
        keep: complete persistent steps to keep (None: all).
    """

    def __init__(self, storage: PersistentStorage, *, job_dir: str, rank: int,
                 group: dist.ProcessGroup | None, pins: Pins, retention: Retention,
                 keep: int | None = None):
        self.storage = storage
        self.keep = keep
        self._writing: dict[int, int] = {}  # step -> writes of it in flight (under _lock)
        self.job_dir = job_dir
        self.rank = rank
        self.group = group
        self.pins = pins
        self.retention = retention
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="mlckpt-persist")
        self._lock = threading.Lock()
        self._futures: dict[Future[None], int] = {}  # background writes not yet waited for: their steps

    def write(self, state_dict: dict[str, Any], step: int, lineage: Lineage) -> None:
        """Write ``step`` now, in this thread; ``lineage``: the run saving it (recorded beside
        the step by rank 0, ``PersistentOrigin``)."""
        t0 = time.perf_counter()
        with self._lock:
            self._writing[step] = self._writing.get(step, 0) + 1
        try:
            dcp.save(state_dict, storage_writer=self.storage.writer(step), process_group=self.group)
        except CheckpointException as e:
            err = unwrap_checkpoint_exception(e, f"persistent save of step {step}")
            log.error("mlcheckpoint: %s", err)
            raise err from None
        finally:
            with self._lock:
                self._writing[step] -= 1
                if not self._writing[step]:
                    del self._writing[step]
        if self.rank == 0:
            self._record_origin(step, lineage)
        seconds = time.perf_counter() - t0
        log.info("mlcheckpoint: persistent checkpoint of step %d written to %s in %.2fs",
                 step, self.storage.path(step), seconds)
        history.record(self.job_dir, "persistent", step=step, rank=self.rank,
                       seconds=round(seconds, 6), location=self.storage.path(step))
        self.prune()

    def _record_origin(self, step: int, lineage: Lineage) -> None:
        """Which run wrote ``step``, for recovery to weigh it against memory. Without it the
        step is still loadable: a failure is logged, never raised."""
        origin = PersistentOrigin(lineage.run_id, lineage.ancestors, time.time())
        try:
            self.storage.record_origin(step, origin)
        except OSError as e:
            log.warning("mlcheckpoint: recording which run wrote persistent step %d failed: %s",
                        step, e)

    def prune(self) -> list[int]:
        """Rank 0: remove the persistent steps beyond ``keep`` (after a write that succeeded,
        or when a framework's own write to the folder did); returns them. A failure to list or
        remove is logged, never raised: the write it follows succeeded."""
        if self.keep is None or self.rank != 0:
            return []
        with self._lock:
            writing = set(self._writing)
        try:
            removed = self.storage.prune(self.keep, spare=writing)
        except OSError as e:
            log.warning("mlcheckpoint: pruning the persistent folder %s failed: %s",
                        self.storage.location, e)
            return []
        if removed:
            history.record(self.job_dir, "persistent_pruned", steps=removed, rank=self.rank,
                           keep=self.keep)
        return removed

    def prune_later(self) -> None:
        """``prune`` on the writer's thread, after the writes queued there."""
        if self.keep is not None and self.rank == 0:
            self._executor.submit(self.prune)

    def submit(self, staged: dict[str, Any], step: int, lineage: Lineage) -> None:
        """Write ``step`` in the background from ``staged``, the views of its tmpfs buffers."""
        self.pins.pin(step)
        try:
            future = self._executor.submit(self._write_pinned, staged, step, lineage)
        except BaseException:
            self.pins.unpin(step)
            raise
        with self._lock:
            self._futures = {f: s for f, s in self._futures.items() if not f.done() or f.exception()}
            self._futures[future] = step

    def write_now(self, state_dict: dict[str, Any], step: int, lineage: Lineage
                  ) -> BaseException | None:
        """Write ``step`` from ``state_dict`` and return once written: the in-memory save of
        ``step`` failed on every rank, and the persistent step asked for is written anyway.
        On the writer's thread, after the writes queued there (one thread runs this group's
        collectives). Returns the failure (already logged on every rank), which ``wait`` also
        raises; None once written."""
        future = self._executor.submit(self.write, state_dict, step, lineage)
        with self._lock:
            self._futures[future] = step
        return future.exception()

    def _write_pinned(self, staged: dict[str, Any], step: int, lineage: Lineage) -> None:
        try:
            pause_point("persistent_write", step, self.rank)
            self.write(staged, step, lineage)
        finally:
            self.pins.unpin(step)
            self.retention.apply()  # the step may have been held past ``keep``

    def wait(self) -> None:
        """Wait for every background write; raise the first failure among those not raised
        yet (each failure is raised once)."""
        with self._lock:
            pending, self._futures = list(self._futures), {}
        errors = [e for e in (f.exception() for f in pending if not f.cancelled()) if e is not None]
        if errors:
            raise errors[0]

    def close(self, wait: bool) -> bool:
        """Stop the writer thread (``wait``: after the writes in flight; otherwise the queued
        ones are cancelled, and their steps unpinned). Returns whether no write still runs."""
        self._executor.shutdown(wait=wait, cancel_futures=not wait)
        with self._lock:
            for future, step in self._futures.items():
                if future.cancelled():  # never ran: _write_pinned did not unpin it
                    self.pins.unpin(step)
            self._futures = {f: s for f, s in self._futures.items() if not f.cancelled()}
            return all(f.done() for f in self._futures)

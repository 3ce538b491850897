"""Saver: the save path behind ``CheckpointManager.save`` and ``async_save``.

Read top to bottom: ``save`` (or ``async_save``: stage now or overlapped, then
``_finish_async_save`` on the save thread) -> ``dcp.save`` through a ``MemoryStorageWriter``
-> ``_after_save`` (history, the metadata on every node, the replicator, retention, the next
buffers) -> the persistent write, if asked. At most one in-memory save is in flight.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict_saver import _stateful_to_state_dict

from . import history
from ._gc import gc_paused
from .dcp import MemoryStorageWriter
from .dcp.errors import unwrap_checkpoint_exception
from .dcp.writer import commit_metadata
from .errors import MLCheckpointError
from .lifecycle import BufferWarmer, Retention
from .persistent_writer import PersistentWriter
from .replication import Replicator
from .snapshot import Snapshotter
from .store import LocalStore
from .store.identity import Lineage
from .topology import Topology

log = logging.getLogger(__name__)


@dataclass
class SaveResult:
    step: int
    bytes: int
    blocking_seconds: float  # time the caller was held (staging for async_save)
    seconds: float  # until committed in tmpfs on every rank
    persistent: bool = False
    overlapped_bytes: int = 0  # copied on the staging thread while training went on


class Saver:
    """Saves steps of one CheckpointManager into ``store``; collective over ``group``.

    Args:
        store, topology: this node's store and where this rank sits in the job.
        group: the in-memory saves' process group.
        snapshots: the staging thread and guards of overlapped saves.
        retention: applied after every save.
        warmer: prepares the buffers of the next saves.
        replicator: told of every committed shard and metadata; None with replication off.
    """

    def __init__(self, store: LocalStore, topology: Topology, *, group: dist.ProcessGroup | None,
                 snapshots: Snapshotter, retention: Retention, warmer: BufferWarmer,
                 replicator: Replicator | None):
        self.store = store
        self.topology = topology
        self.group = group
        self.snapshots = snapshots
        self.retention = retention
        self.warmer = warmer
        self.replicator = replicator
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="mlckpt-save")
        self._lock = threading.Lock()
        self._in_flight: Future[SaveResult] | None = None
        self._overlapped_step: int | None = None  # the save in flight, if it was overlapped

    def writer(self, step: int, lineage: Lineage) -> MemoryStorageWriter:
        """A writer of ``step`` that tells the replicator of each commit."""
        notify = None
        if self.replicator is not None:
            self.replicator.activate()
            notify = self.replicator.notify
        return MemoryStorageWriter(step, self.store, on_commit=notify, on_metadata=notify,
                                   lineage=lineage, snapshots=self.snapshots)

    def save(self, state_dict: dict[str, Any], step: int, lineage: Lineage,
             persist: PersistentWriter | None) -> SaveResult:
        """Save ``step`` and return once it is committed on every rank (and, with ``persist``,
        written to the persistent folder)."""
        self.wait()
        self._raise_overlapped_failure()
        writer = self.writer(step, lineage)
        t0 = time.perf_counter()
        try:
            with gc_paused():
                metadata = dcp.save(state_dict, storage_writer=writer, process_group=self.group)
        except CheckpointException as e:
            self._drop_failed_shard(writer)
            raise unwrap_checkpoint_exception(e, f"save of step {step}") from None
        seconds = time.perf_counter() - t0
        result = SaveResult(step, _committed_bytes(writer), seconds, seconds, persist is not None)
        self._after_save(result, metadata, writer)
        if persist is not None:
            persist.write(state_dict, step)
        return result

    def async_save(self, state_dict: dict[str, Any], step: int, lineage: Lineage,
                   persist: PersistentWriter | None, overlap: bool | None) -> Future[SaveResult]:
        """Stage ``state_dict`` (see ``CheckpointManager.async_save``), then commit on the save
        thread."""
        self.wait()
        self._raise_overlapped_failure()
        overlapped = self.snapshots.guarded if overlap is None else overlap
        writer = self.writer(step, lineage)
        t0 = time.perf_counter()
        stage_error: BaseException | None = None
        staged: dict[str, Any] | Future[dict[str, Any]] = {}
        try:
            with gc_paused():
                flat = _stateful_to_state_dict(state_dict)  # Stateful objects: at call time
                if overlapped:
                    staged = writer.stage_overlapped(
                        flat, None if overlap else self.snapshots.deferrable())
                else:
                    staged = writer.stage_now(flat)
        except (MLCheckpointError, OSError) as e:
            stage_error, staged = e, {}
            writer.poison(e)  # fail this step on every rank instead of leaving them waiting
        blocking = time.perf_counter() - t0
        fut = self._executor.submit(self._finish_async_save, writer, staged, persist, t0, blocking)
        with self._lock:
            self._in_flight = fut
            self._overlapped_step = step if overlapped and stage_error is None else None
        if stage_error is not None:
            raise stage_error
        return fut

    def _raise_overlapped_failure(self) -> None:
        """The previous save overlapped and failed (on some rank: the commit is collective):
        raise that here, once, on every rank alike, so that all ranks skip this call together
        (even the rank whose guard raised it already)."""
        with self._lock:
            fut, step, self._overlapped_step = self._in_flight, self._overlapped_step, None
        error = fut.exception() if step is not None and fut is not None else None
        if error is not None:
            self.snapshots.forget_failure()
            raise error

    def _finish_async_save(self, writer: MemoryStorageWriter,
                           staged: dict[str, Any] | Future[dict[str, Any]],
                           persist: PersistentWriter | None, t0: float,
                           blocking: float) -> SaveResult:
        if isinstance(staged, Future):
            staged = staged.result()  # the staging thread's copy; its failure poisoned writer
        try:
            with gc_paused():
                metadata = dcp.save(staged, storage_writer=writer, process_group=self.group)
        except CheckpointException as e:
            self._drop_failed_shard(writer)
            err = unwrap_checkpoint_exception(e, f"async save of step {writer.step}")
            log.error("mlcheckpoint: %s", err)
            raise err from None
        result = SaveResult(writer.step, _committed_bytes(writer), blocking,
                            time.perf_counter() - t0, persist is not None, writer.overlapped_bytes)
        self._after_save(result, metadata, writer)
        if persist is not None:
            persist.submit(staged, writer.step)  # reads the staged views: pins the step
        return result

    def _drop_failed_shard(self, writer: MemoryStorageWriter) -> None:
        """A step that failed on some rank is no checkpoint: give back the space this rank's
        shard of it took (else a CapacityError on one rank leaves the others' shards holding
        the tmpfs for the rest of the run)."""
        if writer.committed is not None:
            with contextlib.suppress(OSError, MLCheckpointError):
                self.store.retire_shard(writer.step, self.topology.rank)

    def _after_save(self, result: SaveResult, metadata: Metadata,
                    writer: MemoryStorageWriter) -> None:
        step, rank = result.step, self.topology.rank
        history.record(self.store.job_dir, "save", step=step, rank=rank, bytes=result.bytes,
                       seconds=round(result.seconds, 6), blocking_seconds=round(result.blocking_seconds, 6))
        # dcp.save returns the global metadata on every rank: every node stores it at once,
        # without waiting for the coordinator's push.
        if self.topology.local_rank == 0 and self.topology.node_rank != 0:
            try:
                self.store.read_metadata(step, writer.save_id)
            except MLCheckpointError:  # none yet, or an earlier save's of this step number
                commit_metadata(self.store, step, metadata, self.topology.world_size,
                                save_id=writer.save_id, lineage=writer.lineage)
        if self.replicator is not None:
            self.replicator.notify()
        self.retention.apply()
        self.warmer.prepare(rank, result.bytes)

    def wait(self) -> None:
        """Wait for the save in flight; its error belongs to the caller of ``async_save``."""
        with self._lock:
            fut = self._in_flight
        if fut is not None:
            fut.exception()

    def close(self, wait: bool) -> bool:
        """Stop the save thread (``wait``: after the save in flight). Returns whether no save
        still runs."""
        self._executor.shutdown(wait=wait, cancel_futures=not wait)
        with self._lock:
            return self._in_flight is None or self._in_flight.done()


def _committed_bytes(writer: MemoryStorageWriter) -> int:
    return writer.committed.data_bytes if writer.committed is not None else 0

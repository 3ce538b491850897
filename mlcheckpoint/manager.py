"""CheckpointManager: what a training loop calls. Ties the store, DCP adapters, replication,
recovery and the persistent fallback together.

    ckpt = CheckpointManager(persistent_dir="/nfs/run42")
    info = ckpt.resume(state_dict)
    for step in range(0 if info.step is None else info.step + 1, total):
        train_step()
        ckpt.async_save(state_dict, step, persistent=(step % 500 == 0))
    ckpt.close()
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import _stateful_to_state_dict
from typing_extensions import Self

from . import history
from ._gc import gc_paused
from .dcp import MemoryStorageReader, MemoryStorageWriter
from .dcp.errors import unwrap_checkpoint_exception
from .dcp.writer import commit_metadata
from .errors import ConfigError, MLCheckpointError
from .options import Options
from .persistent import PersistentStorage, open_persistent
from .recovery import Recovery, ResumeInfo
from .recovery.resume import Comm
from .replication import Pins, ReceiveSink, Rendezvous, Replicator
from .replication.factory import make_transport
from .snapshot import GuardHandle, Snapshotter
from .store import LocalStore
from .store.identity import Lineage, new_id
from .store.retention import RetentionPolicy
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


@dataclass
class CheckpointEntry:
    """One row of ``CheckpointManager.checkpoints()``."""

    step: int
    location: str  # "memory" or "persistent"
    state: str  # "complete", "incomplete"
    bytes: int | None
    ranks: list[int] = field(default_factory=list)  # ranks whose shards are on this node
    replication: str | None = None  # this rank's shard: committed | replicated | failed: why | ...
    protected: bool | None = None  # every shard and the metadata on two nodes (job-wide)


class CheckpointManager:
    """In-memory checkpoints with a persistent fallback, for one training job.

    Every rank of the job constructs one, at the same point in the program (it creates
    dedicated gloo process groups, so checkpoint collectives never share the training group).

    Args:
        persistent_dir: directory or fsspec URL for long-term DCP checkpoints, a
            ``PersistentStorage`` that speaks a framework's folder layout, or None.
        job_id: defaults to MLCHECKPOINT_JOB_ID, TORCHELASTIC_RUN_ID, SLURM_JOB_ID, then an id
            derived from ``persistent_dir`` (logged); without any of them, ConfigError.
        local_dir: tmpfs directory; defaults to MLCHECKPOINT_LOCAL_DIR or /dev/shm/mlcheckpoint.
        keep: complete in-memory checkpoints kept per rank (the newest ones).
        memory_limit_bytes: cap on this job's tmpfs usage on this node (default
            MLCHECKPOINT_MEMORY_LIMIT; None: only the tmpfs free space).
        replication: "tcp", "pg" (gloo), "nccl" (GPU buffers over NCCL) or "none". Off by
            itself on a single node.
        replication_host: interface the TCP listener binds (default: the one routing to
            MASTER_ADDR; env MLCHECKPOINT_REPLICATION_HOST).
        replication_timeout: seconds any single replication socket operation may block.
        replication_streams: TCP connections one large shard is pushed over (default
            ``$MLCHECKPOINT_TCP_STREAMS`` or 4; each stream carries at least 64 MiB).
    """

    def __init__(self, persistent_dir: str | PersistentStorage | None = None, *,
                 job_id: str | None = None, local_dir: str | None = None, keep: int = 2,
                 memory_limit_bytes: int | str | None = None, replication: str = "tcp",
                 replication_host: str | None = None, replication_timeout: float = 60.0,
                 replication_streams: int | None = None):
        self.persistent = open_persistent(persistent_dir)
        # Every argument and MLCHECKPOINT_* variable, resolved and checked before anything is
        # written. Plain torchrun gives no job id: the persistent folder, which a restart
        # keeps, names one.
        self.options = opts = Options.resolve(
            job_id=job_id, local_dir=local_dir, keep=keep, memory_limit_bytes=memory_limit_bytes,
            replication=replication, replication_host=replication_host,
            replication_timeout=replication_timeout, replication_streams=replication_streams,
            derive_job_id_from=None if self.persistent is None else self.persistent.location)
        replication, replication_host = opts.replication, opts.replication_host
        replication_timeout = opts.replication_timeout
        replication_streams = opts.replication_streams
        self.topology = Topology.detect()
        self.rank = self.topology.rank
        self.keep = opts.keep
        self.store = LocalStore(opts.local_dir, opts.job_id,
                                memory_limit_bytes=opts.memory_limit_bytes)
        self.job_id = self.store.job_id
        self._distributed = dist.is_available() and dist.is_initialized()
        # Two groups: in-memory saves and persistent writes run on different threads and must
        # not interleave their collectives; neither may share the training group.
        self._save_pg = dist.new_group(backend="gloo") if self._distributed else None
        self._persist_pg = dist.new_group(backend="gloo") if self._distributed else None
        # This run's identity, agreed by every rank (rank 0's): every save names it, and a
        # resume extends it with the run it loaded from (see store/identity.py).
        self.lineage = Lineage(self._all_gather(new_id())[0])
        self._save_executor = ThreadPoolExecutor(1, thread_name_prefix="mlckpt-save")
        self._persist_executor = ThreadPoolExecutor(1, thread_name_prefix="mlckpt-persist")
        self._in_flight: Future | None = None
        self.snapshots = Snapshotter()  # overlapped saves: the staging thread and the guards
        self._overlapped_step: int | None = None  # the save in flight, if it was overlapped
        self._persist_futures: list[Future] = []
        self.pins = Pins()  # steps whose buffers a transfer or persistent write reads
        self._lock = threading.Lock()
        self._closed = False
        self.replicator: Replicator | None = None
        self.replica_owners: list[int] = []
        self._heal_thread: threading.Thread | None = None
        self._warmer: threading.Thread | None = None  # prepares buffers of the next saves
        self._prepared: dict[int, int] = {}  # owner rank -> shard size its buffers were made for
        if replication != "none" and self.topology.num_nodes == 1:
            log.info("mlcheckpoint: single node, replication off (nothing to pair with)")
            replication = "none"
        if replication != "none" and not self._distributed:
            log.info("mlcheckpoint: no process group initialised, replication off")
            replication = "none"
        self.replication_mode = replication
        if replication != "none":
            self._start_replication(replication, replication_host, replication_timeout,
                                    replication_streams)
            assert self.replicator is not None
            self.replicator.transport.accept_from(self.lineage)
        log.debug("CheckpointManager job=%s dir=%s rank=%d/%d node=%d/%d", self.job_id,
                  self.store.job_dir, self.rank, self.topology.world_size,
                  self.topology.node_rank, self.topology.num_nodes)

    def _start_replication(self, mode: str, host: str | None, timeout: float,
                           streams: int | None) -> None:
        # The replication secret is agreed over our own gloo group, never the c10d store.
        rdzv = Rendezvous.from_default_group(self.job_id, group=self._save_pg)
        sink = ReceiveSink(self.store, pins=self.pins, on_received=self._on_replica_received)
        transport = make_transport(mode, self.store, rdzv, sink, host=host, timeout=timeout,
                                   streams=streams)
        self.replicator = Replicator(self.store, transport, rdzv, self.topology)
        self.replica_owners = self.replicator.sources

    def _on_replica_received(self, step: int, owner: int) -> None:
        # Runs on a listener thread: use the last known protected step rather than asking the
        # c10d store (a new client per connection thread); a stale value only keeps more.
        self._retention().apply(self.store, [owner], ask=False)
        with contextlib.suppress(MLCheckpointError):
            self._prepare_buffers(owner, self.store.read_manifest(step, owner).data_bytes)

    # ------------------------------------------------------------------ DCP-native
    def storage_writer(self, step: int) -> MemoryStorageWriter:
        """A writer for ``dcp.save`` / ``dcp.async_save`` of ``step``.

        Retires this rank's checkpoints beyond ``keep`` first, so their buffers are reused.
        """
        self._check_open()
        self._apply_retention()
        return self._writer(step)

    def _writer(self, step: int) -> MemoryStorageWriter:
        # save/async_save retire old steps after each save, on the background thread, so they
        # skip the up-front retention (an inventory and c10d round trips on the training thread).
        notify = None
        if self.replicator is not None:
            self.replicator.activate()
            notify = self.replicator.notify
        return MemoryStorageWriter(step, self.store, on_commit=notify, on_metadata=notify,
                                   lineage=self.lineage, snapshots=self.snapshots)

    def storage_reader(self, step: int) -> MemoryStorageReader:
        """A reader for ``dcp.load`` of an in-memory ``step``."""
        return MemoryStorageReader(step, self.store)

    # ------------------------------------------------------------------ save
    def save(self, state_dict: dict[str, Any], step: int, *, persistent: bool = False) -> SaveResult:
        """Save ``step`` and return once it is committed in tmpfs on every rank."""
        self._check_open()
        self._check_persistent(persistent)
        self._wait_in_flight()
        self._raise_overlapped_failure()
        writer = self._writer(step)
        t0 = time.perf_counter()
        try:
            with gc_paused():
                metadata = dcp.save(state_dict, storage_writer=writer, process_group=self._save_pg)
        except CheckpointException as e:
            self._drop_failed_shard(writer)
            raise unwrap_checkpoint_exception(e, f"save of step {step}") from None
        seconds = time.perf_counter() - t0
        result = SaveResult(step, _committed_bytes(writer), seconds, seconds, persistent)
        self._after_save(result, metadata, writer.save_id)
        if persistent:
            self._write_persistent(state_dict, step)
        return result

    def guard(self, optimizer: torch.optim.Optimizer) -> GuardHandle:
        """Make ``async_save`` overlap its copy with the next step: every
        ``optimizer.step()`` first waits until the snapshot in flight is taken.

        Call once per optimizer, after creating it. From then on ``async_save`` returns
        without copying the optimizer's parameters and state (only ``optimizer.step()``
        changes them); they are copied on a background thread while forward and backward
        run. Everything else in the state dict is captured when ``async_save`` is called.
        Returns a handle whose ``remove()`` takes the guard off.
        """
        return self.snapshots.guard(optimizer)

    def wait_staged(self) -> None:
        """Wait until the snapshot of the save in flight is taken: call it before changing a
        guarded optimizer's tensors outside ``optimizer.step()`` (or any tensor, after
        ``async_save(..., overlap=True)``). Raises this rank's staging failure, if any."""
        self.snapshots.wait()

    def async_save(self, state_dict: dict[str, Any], step: int, *,
                   persistent: bool = False, overlap: bool | None = None) -> Future[SaveResult]:
        """Snapshot ``state_dict`` into tmpfs; commit (and persist) in the background.

        ``overlap``: None (default) overlaps the copy of guarded optimizers' tensors with
        training once ``guard(optimizer)`` was called, and otherwise returns once every byte
        is copied; False always copies before returning; True copies every tensor in the
        background, and the caller must call ``wait_staged()`` before changing any of them.
        Everything that is not a tensor (``state_dict()`` of Stateful objects, scalars) is
        captured at call time.

        At most one in-memory save is in flight: a second call first waits for the previous
        one. The future's result is a SaveResult. A failure while copying here (e.g.
        CapacityError) is raised at once; a failure of an overlapped copy is raised at this
        rank's next guard point, and the failed step at every rank's next save or async_save
        (which then saves nothing: call it again). Either way the other ranks' saves of this
        step fail too (no rank waits for it) and the previous step stays resumable.
        """
        self._check_open()
        self._check_persistent(persistent)
        self._wait_in_flight()
        self._raise_overlapped_failure()
        overlapped = self.snapshots.guarded if overlap is None else overlap
        writer = self._writer(step)
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
        fut = self._save_executor.submit(self._finish_async_save, writer, staged, step,
                                         persistent, t0, blocking)
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
                           staged: dict[str, Any] | Future[dict[str, Any]], step: int,
                           persistent: bool, t0: float, blocking: float) -> SaveResult:
        if isinstance(staged, Future):
            staged = staged.result()  # the staging thread's copy; its failure poisoned writer
        try:
            with gc_paused():
                metadata = dcp.save(staged, storage_writer=writer, process_group=self._save_pg)
        except CheckpointException as e:
            self._drop_failed_shard(writer)
            err = unwrap_checkpoint_exception(e, f"async save of step {step}")
            log.error("mlcheckpoint: %s", err)
            raise err from None
        result = SaveResult(step, _committed_bytes(writer), blocking, time.perf_counter() - t0,
                            persistent, writer.overlapped_bytes)
        self._after_save(result, metadata, writer.save_id)
        if persistent:
            # The persistent write reads the staged views of this step's tmpfs buffers: pin the
            # step so retention does not recycle them meanwhile.
            self.pins.pin(step)
            pf = self._persist_executor.submit(self._write_persistent, staged, step, True)
            with self._lock:
                self._persist_futures = [f for f in self._persist_futures if not f.done()] + [pf]
        return result

    def _drop_failed_shard(self, writer: MemoryStorageWriter) -> None:
        """A step that failed on some rank is no checkpoint: give back the space this rank's
        shard of it took (else a CapacityError on one rank leaves the others' shards holding
        the tmpfs for the rest of the run)."""
        if writer.committed is not None:
            with contextlib.suppress(OSError, MLCheckpointError):
                self.store.retire_shard(writer.step, self.rank)

    def _write_persistent(self, state_dict: dict[str, Any], step: int, pinned: bool = False) -> None:
        assert self.persistent is not None, "persistent=True needs CheckpointManager(persistent_dir=...)"
        t0 = time.perf_counter()
        try:
            dcp.save(state_dict, storage_writer=self.persistent.writer(step),
                     process_group=self._persist_pg)
            seconds = time.perf_counter() - t0
            log.info("mlcheckpoint: persistent checkpoint of step %d written to %s in %.2fs",
                     step, self.persistent.path(step), seconds)
            history.record(self.store.job_dir, "persistent", step=step, rank=self.rank,
                           seconds=round(seconds, 6), location=self.persistent.path(step))
        except CheckpointException as e:
            err = unwrap_checkpoint_exception(e, f"persistent save of step {step}")
            log.error("mlcheckpoint: %s", err)
            raise err from None
        finally:
            if pinned:
                self.pins.unpin(step)
                self._apply_retention()  # the step may have been held past ``keep``

    def _after_save(self, result: SaveResult, metadata: Any, save_id: str) -> None:
        step = result.step
        history.record(self.store.job_dir, "save", step=step, rank=self.rank, bytes=result.bytes,
                       seconds=round(result.seconds, 6), blocking_seconds=round(result.blocking_seconds, 6))
        # dcp.save returns the global metadata on every rank: every node stores it at once,
        # without waiting for the coordinator's push.
        if self.topology.local_rank == 0 and self.topology.node_rank != 0:
            try:
                self.store.read_metadata(step, save_id)
            except MLCheckpointError:  # none yet, or an earlier save's of this step number
                commit_metadata(self.store, step, metadata, self.topology.world_size,
                                save_id=save_id, lineage=self.lineage)
        if self.replicator is not None:
            self.replicator.notify()
        self._apply_retention()
        self._prepare_buffers(self.rank, result.bytes)

    def _prepare_buffers(self, owner: int, nbytes: int) -> None:
        """Make the buffers of ``owner``'s next checkpoints now, on a background thread, so
        the first ``keep`` saves (or received replicas) after this one do not touch fresh
        tmpfs pages. Once a steady state recycles buffers this does nothing."""
        with self._lock:
            if (self._closed or nbytes <= 0 or self._prepared.get(owner, -1) >= nbytes
                    or (self._warmer is not None and self._warmer.is_alive())):
                return
            self._prepared[owner] = nbytes
            self._warmer = threading.Thread(target=self._warm, args=(owner, nbytes), daemon=True,
                                            name="mlckpt-prepare")
            self._warmer.start()

    def _warm(self, owner: int, nbytes: int) -> None:
        try:
            self.store.prewarm(owner, nbytes, self.keep)
        except (OSError, MLCheckpointError) as e:  # only an optimisation: saves still work
            log.warning("mlcheckpoint: could not prepare buffers for rank %d: %s", owner, e)

    def _retention(self) -> RetentionPolicy:
        """Retention's policy: ``keep`` steps per owner, never a step being read nor the newest
        replicated everywhere (stateless: made from what the manager holds now)."""
        return RetentionPolicy(self.keep, self.pins, self.replicator)

    def _apply_retention(self) -> None:
        """Retire this rank's own shards and the replicas it keeps beyond ``keep``."""
        self._retention().apply(self.store, [self.rank, *self.replica_owners])

    # ------------------------------------------------------------------ resume
    def resume(self, state_dict: dict[str, Any]) -> ResumeInfo:
        """Load the newest usable checkpoint into ``state_dict`` (in place); all ranks call it.

        Picks the newest step complete across the surviving nodes (fetching what a replaced
        node lacks from its partner), unless the persistent checkpoint is newer. Copies whose
        checksums fail are refused by all ranks together and the next candidate is tried:
        another copy, an older step, the persistent step, then a fresh start (step None).
        """
        self._check_open()
        self._wait_in_flight()
        resumed = self._recovery().run(state_dict)
        self.lineage = resumed.lineage  # later saves descend from what was loaded
        self._heal_thread = resumed.healing  # a replaced node's own shard, coming back
        info = resumed.info
        history.record(self.store.job_dir, "resume", step=info.step, rank=self.rank,
                       source=info.sources.get(self.rank, info.source), seconds=round(info.seconds, 6),
                       bytes=resumed.bytes_fetched, reason=info.reason)
        return info

    def continue_from(self, step: int | None) -> None:
        """The job continues from ``step`` (None: from scratch), restored without ``resume``:
        e.g. a framework loaded a checkpoint the user named from its own folder. Call it
        instead of ``resume`` on every rank (collective). In-memory steps newer than ``step``
        are dropped on every node, as after a resume: the job saves new ones under their
        numbers, and retention must not keep the abandoned ones as the newest."""
        self._check_open()
        self._wait_in_flight()
        self._recovery().continue_from(step)

    def _recovery(self) -> Recovery:
        return Recovery(self.store, self.topology, Comm(self._all_gather), lineage=self.lineage,
                        group=self._save_pg, replicator=self.replicator, persistent=self.persistent)

    # ------------------------------------------------------------------ listing
    def checkpoints(self) -> list[CheckpointEntry]:
        """In-memory steps on this node and persistent steps, oldest first."""
        entries = []
        for step, st in self.store.inventory().items():
            entry = CheckpointEntry(step, "memory", "complete" if st.complete else "incomplete",
                                    st.total_bytes, sorted(st.committed_ranks))
            if self.replicator is not None:
                rep = self.replicator.state(step)
                entry.replication = None if rep is None else (
                    rep.state if rep.reason is None else f"{rep.state}: {rep.reason}")
                entry.protected = self.replicator.is_protected(step)
            entries.append(entry)
        if self.persistent is not None:
            for step in self.persistent.steps():
                entries.append(CheckpointEntry(step, "persistent", "complete",
                                               self.persistent.size_bytes(step)))
        return sorted(entries, key=lambda e: (e.step, e.location))

    def wait_replicated(self, step: int, timeout: float = 60.0) -> bool:
        """Wait until every shard and the metadata of ``step`` are on two nodes (job-wide).

        Returns False on timeout. With replication off, returns whether the step is complete
        locally (there is nothing more to wait for).
        """
        if self.replicator is None:
            return step in self.store.complete_steps()
        return self.replicator.wait_replicated(step, timeout)

    # ------------------------------------------------------------------ lifecycle
    def wait(self) -> None:
        """Block until every save, persistent write and post-resume repair has finished."""
        self._wait_in_flight()
        if self._heal_thread is not None:
            self._heal_thread.join()
        with self._lock:
            pending = list(self._persist_futures)
        for f in pending:
            f.exception()  # wait; errors were logged where they happened

    def close(self, failed: bool | None = None, *, timeout: float = 60.0) -> None:
        """Wait for saves and replication in flight, then release threads, sockets and
        mappings. Idempotent.

        When the job ends normally this is collective: every rank calls it, and each waits at
        most ``timeout`` seconds for the others (partners may still be pushing replicas to it)
        before closing anyway. When the job is failing it waits for no other rank and no
        collective work in flight, so a rank that raised exits at once instead of being held by
        ranks that will never come. Failing means ``failed=True``, or, by default, that close is
        called while an exception is being handled (from an ``except`` block, as torchtitan's
        trainer does, or from ``with`` on an error).
        """
        if self._closed:
            return
        if failed is None:
            failed = sys.exc_info()[1] is not None
        try:
            if failed:
                log.warning("mlcheckpoint: closing after an error on this rank: not waiting for "
                            "other ranks or for saves in flight")
            else:
                self.wait()
                if self.replicator is not None:
                    self.replicator.drain(timeout=timeout)
                if self._distributed:
                    # Partners may still push to our listener: close only once everyone drained.
                    self._barrier(timeout)
        finally:
            self._release(wait=not failed)

    def _barrier(self, timeout: float) -> None:
        """A barrier on the checkpoint group that gives up after ``timeout`` seconds: a rank
        that never arrives (it failed) must not hold the others until the group's own timeout."""
        try:
            dist.barrier(group=self._save_pg, async_op=True).wait(timeout=timedelta(seconds=timeout))
        except RuntimeError as e:  # timed out, or a peer is gone
            log.warning("mlcheckpoint: not every rank reached close() within %.0fs; closing "
                        "anyway (%s)", timeout, str(e).splitlines()[0] if str(e) else e)

    def _release(self, wait: bool) -> None:
        self._closed = True
        # Not waiting: a snapshot in flight fails rather than commits what training changes.
        self.snapshots.close(wait=wait)
        self._save_executor.shutdown(wait=wait, cancel_futures=not wait)
        self._persist_executor.shutdown(wait=wait, cancel_futures=not wait)
        with self._lock:
            warmer = self._warmer
            futures = [f for f in [self._in_flight, *self._persist_futures] if f is not None]
        if warmer is not None and wait:
            warmer.join()
        if self.replicator is not None:
            self.replicator.close()
            self.replicator.transport.close()
        threads = [t for t in (warmer, self._heal_thread) if t is not None]
        if all(f.done() for f in futures) and not any(t.is_alive() for t in threads):
            # Else (a failing close) work still running uses these mappings: they go with the
            # process.
            self.store.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close(failed=exc_type is not None)

    def _check_open(self) -> None:
        if self._closed:
            raise MLCheckpointError("CheckpointManager is closed")

    def _check_persistent(self, persistent: bool) -> None:
        # Refused at the call, before anything is staged or pinned.
        if persistent and self.persistent is None:
            raise ConfigError("persistent=True needs CheckpointManager(persistent_dir=...): "
                              "no persistent folder was given")

    def _wait_in_flight(self) -> None:
        with self._lock:
            fut = self._in_flight
        if fut is not None:
            fut.exception()  # wait; the caller of async_save owns the result

    # ------------------------------------------------------------------ collectives
    def _all_gather(self, obj: Any) -> list[Any]:
        if not self._distributed:
            return [obj]
        out: list[Any] = [None] * dist.get_world_size(self._save_pg)
        dist.all_gather_object(out, obj, group=self._save_pg)
        return out


def _committed_bytes(writer: MemoryStorageWriter) -> int:
    return writer.committed.data_bytes if writer.committed is not None else 0


"""CheckpointManager: what a training loop calls. Ties the store, DCP adapters, replication,
recovery and the persistent fallback together; each public method is a few lines that hand
over to a collaborator built in ``__init__``: ``Saver`` (manager/saving.py, the save path),
``PersistentWriter`` (manager/persistent_writer.py), ``Recovery`` (recovery/), ``Lifecycle``
(manager/lifecycle.py: pins, retention, buffer warming), ``Replicator`` (replication/). A training
loop that uses it: ``examples/quickstart.py``.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from typing_extensions import Self

from .. import history
from ..collectives import Comm
from ..dcp import MemoryStorageReader, MemoryStorageWriter
from ..dcp.snapshot import GuardHandle, Snapshotter
from ..errors import ConfigError, MLCheckpointError
from ..persistent import PersistentStorage, open_persistent
from ..recovery import Recovery, ResumeInfo
from ..replication import ReceiveSink, Rendezvous, Replicator, StepReplication
from ..replication.core import network
from ..replication.factory import make_transport
from ..replication.schedule.pairing import pairing_for, sources
from ..replication.schedule.status import ProtectionStatus, save_times
from ..replication.schedule.status import status as protection_status
from ..settings import BY_NAME, Launcher, Options, ReplicationOptions, Timeouts, default
from ..store import LocalStore
from ..store.claim import mark_finished
from ..store.identity import Lineage, new_id
from ..store.inventory import Arrivals
from ..tmpfs import RoomCheck
from ..topology import Topology
from ..waiting import deadline_in, wait_until
from . import metrics
from .claiming import claim_job_dir, claimant
from .flush import Flusher, FlushResult
from .lifecycle import Lifecycle
from .listing import CheckpointEntry, list_checkpoints
from .persistent_writer import PersistentWriter
from .preemption import Preemption
from .saving import Saver, SaveResult

log = logging.getLogger(__name__)


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
        keep_persistent: complete persistent checkpoints kept (the newest ones; default
            ``$MLCHECKPOINT_KEEP_PERSISTENT``; None: all): rank 0 prunes after each
            persistent write, never the newest complete step or one being written.
        memory_limit_bytes: cap on this job's tmpfs usage on this node (default
            MLCHECKPOINT_MEMORY_LIMIT; None: only the tmpfs free space).
        replication: a ``ReplicationOptions`` (transport, listener, streams, bandwidth,
            partners, failure domain), or only its mode: "tcp" (default), "pg", "nccl" or
            "none". Off by itself on a single node.
        options: every setting above in one ``Options``, instead of the keywords.

    The flat replication keywords of earlier releases (``replication_streams=4``, ...,
    ``replicas``, ``failure_domain``) still work for this release, with a DeprecationWarning
    naming their ``ReplicationOptions`` field. ``ckpt.options`` holds every setting resolved.
    """

    def __init__(self, persistent_dir: str | PersistentStorage | None = None, *,
                 job_id: str | None = None, local_dir: str | None = None,
                 keep: int = default("keep"), keep_persistent: int | None = None,
                 memory_limit_bytes: int | str | None = None,
                 replication: ReplicationOptions | str | None = None,
                 options: Options | None = None, **deprecated: Any):
        self._persistent = open_persistent(persistent_dir)
        # Every argument and variable, resolved and checked before anything is written. Plain
        # torchrun gives no job id: the persistent folder, which a restart keeps, names one.
        given = Options.of("CheckpointManager", options, job_id=job_id, local_dir=local_dir,
                           keep=keep, keep_persistent=keep_persistent,
                           memory_limit_bytes=memory_limit_bytes, replication=replication,
                           deprecated=deprecated)
        self.options = opts = given.resolved(
            derive_job_id_from=None if self._persistent is None else self._persistent.location)
        repl = opts.replication
        network.check_listen_settings(repl.host, repl.interface,
                                      host_given=given.replication.host is not None,
                                      interface_given=given.replication.interface is not None)
        self._launcher = Launcher.from_env()
        self._timeouts = Timeouts(replication=repl.timeout)
        self._topology = Topology.detect(self._launcher)
        self.rank = self._topology.rank
        self._store = LocalStore(opts.local_dir, opts.job_id,
                                 memory_limit_bytes=opts.memory_limit_bytes)
        self.job_id = self._store.job_id
        self._distributed = dist.is_available() and dist.is_initialized()
        # Two groups: in-memory saves and persistent writes run on different threads and must
        # not interleave their collectives; neither may share the training group.
        self._save_pg = dist.new_group(backend="gloo") if self._distributed else None
        self._persist_pg = dist.new_group(backend="gloo") if self._distributed else None
        self._comm = Comm(self._save_pg)
        self._dcp_pg: dist.ProcessGroup | None = None  # DCP-native saves': ``process_group``
        # One collective agrees this run's identity (rank 0's; see store/identity.py), every
        # node's failure domain and rank 0's replica count (the pairing follows them).
        agreed = self._comm.all_gather((new_id(), repl.failure_domain, repl.replicas))
        self._lineage = Lineage(agreed[0][0])
        self._replicas: int = agreed[0][2]
        self._topology = self._topology.with_domains([domain for _, domain, _ in agreed])
        # One live run per job directory on a node: claimed before anything here reads or
        # changes a file of it; a refusal on any node raises on every rank (manager/claiming.py).
        me = claimant(self._lineage.run_id, self._persistent, self._launcher)
        self._claim = claim_job_dir(self._store.paths, me, self._topology.node_rank,
                                    self._comm.all_gather)
        self._snapshots = Snapshotter(predict_plans=self._topology.world_size > 1)  # staging thread, guards
        # Whose shards this node's ranks retire: theirs (replication adds the partners'); any
        # other owner's, left by an earlier world size, go with their steps.
        self._lifecycle = Lifecycle(self._store, self.rank, opts.keep,
                                    node_owners=self._topology.ranks_of_node(self._topology.node_rank))
        self._persistent_writer = None if self._persistent is None else PersistentWriter(
            self._persistent, job_dir=self._store.job_dir, rank=self.rank,
            group=self._persist_pg, pins=self._lifecycle.pins,
            retention=self._lifecycle.retention, keep=opts.keep_persistent)
        self._closed = False
        self._replicator: Replicator | None = None
        self._heal_thread: threading.Thread | None = None
        self._flusher: Flusher | None = None  # with a persistent folder the flush can write
        self._last_resume: ResumeInfo | None = None  # what this manager's resume() loaded
        mode: str = repl.mode
        if mode != "none" and self._topology.num_nodes == 1:
            log.info("mlcheckpoint: single node, replication off (nothing to pair with)")
            mode = "none"
        if mode != "none" and not self._distributed:
            log.info("mlcheckpoint: no process group initialised, replication off")
            mode = "none"
        self._mode = mode
        self._room = RoomCheck(self._store.local_dir, self._store.paths, self._topology,
                               opts.keep, replica_sets=self._replicas if mode != "none" else 0,
                               reclaimable=self._store.finished_jobs)
        self._room.at_start()  # a container's small /dev/shm: say so now, not at a failed save
        if mode != "none":
            self._start_replication(repl)
        self._saver = Saver(self._store, self._topology, group=self._save_pg,
                            snapshots=self._snapshots, retention=self._lifecycle.retention,
                            warmer=self._lifecycle.warmer, replicator=self._replicator,
                            all_gather=self._comm.all_gather, keep_copies=repl.copies != "off")
        self._preemption = self._preemption_flush()  # last: nothing after it can fail
        log.debug("CheckpointManager job=%s dir=%s rank=%d/%d node=%d/%d", self.job_id,
                  self._store.job_dir, self.rank, self._topology.world_size,
                  self._topology.node_rank, self._topology.num_nodes)

    def _preemption_flush(self) -> Preemption | None:
        """The preemption flush (docs/operations.md, Preemption): on SIGTERM or the notice
        file, unless ``MLCHECKPOINT_PREEMPTION_FLUSH=0``; ``flush_to_persistent`` either way.
        None without a persistent folder the flush can write."""
        if self._persistent is None:
            return None
        refused = self._persistent.flush_refused()
        if refused is not None:
            log.info("mlcheckpoint: no preemption flush: %s", refused)
            return None
        on = bool(BY_NAME["preemption_flush"].resolve())
        transport = None if self._replicator is None else self._replicator.transport
        flusher = Flusher(self._store, self._persistent, self.rank, self._lifecycle.pins,
                          budget=None if transport is None else transport.budget,
                          wait_for_parts=BY_NAME["flush_wait_for_parts"].resolve(),
                          peers=transport)
        self._flusher = flusher
        return Preemption(flusher.flush_and_stay, deadline_s=BY_NAME["flush_deadline"].resolve(),
                          on_sigterm=on,
                          notice_file=BY_NAME["flush_notice_file"].resolve() if on else None)

    def flush_to_persistent(self, timeout: float | None = None) -> FlushResult:
        """Write this rank's part of the newest step memory holds whole to the persistent
        folder now, as a preemption notice does (for a scheduler that announces preemption
        its own way; SIGTERM does it by itself). Every rank calls it; no collective: the step
        is complete once every rank's part is there. Waits for this rank's part (at most
        ``MLCHECKPOINT_FLUSH_DEADLINE``), then up to ``timeout`` seconds (default: that
        deadline) for the other ranks' parts; ``FlushResult.complete`` says whether they
        came. ConfigError without a persistent folder the flush can write (a URL, a
        framework's own layout)."""
        self._check_open()
        flusher = self._flusher
        if self._preemption is None or flusher is None:
            refused = None if self._persistent is None else self._persistent.flush_refused()
            raise ConfigError(f"flush_to_persistent() needs a persistent folder: {refused}"
                              if refused else "flush_to_persistent() needs "
                              "CheckpointManager(persistent_dir=...)")
        result = self._preemption.flush_now("flush_to_persistent()") or FlushResult(
            reason="the flush did not finish within the deadline")
        if result.step is not None and not result.complete:
            wait = self._preemption.deadline_s if timeout is None else timeout
            step = result.step
            result.complete = bool(wait_until(lambda: flusher.complete(step),
                                              deadline_in(wait), poll=0.05))
        return result

    @property
    def replication_mode(self) -> str:
        """The transport replication runs over ("tcp", "pg", "nccl"), or "none": off, as asked
        or because there is no other node or no process group."""
        return self._mode

    def _start_replication(self, repl: ReplicationOptions) -> None:
        # The replication secret is agreed over our own gloo group, never the c10d store.
        rdzv = Rendezvous.from_default_group(self.job_id, self._timeouts.rendezvous,
                                             group=self._save_pg,
                                             generation=self._launcher.restart_count)
        sink = ReceiveSink(self._store, pins=self._lifecycle.pins,
                           subscribers=[self._lifecycle.replica_received])
        transport = make_transport(self._store, rdzv, sink, repl, self._timeouts,
                                   topology=self._topology)
        strategy = pairing_for(self._topology.domains, self._replicas)
        self._replicator = Replicator(self._store, transport, rdzv, self._topology,
                                      poll_interval=self._timeouts.replicator_poll,
                                      wait_poll=self._timeouts.wait_poll, strategy=strategy)
        owners = self._replicator.sources  # whose shards this rank keeps replicas of
        topo = self._topology
        held = [topo.node_rank, *sources(strategy, topo.node_rank, topo.num_nodes)]
        self._lifecycle.retention.protect_replicas(
            self._replicator, owners, node_owners=[r for n in held for r in topo.ranks_of_node(n)])
        # Room for what the partners' replicas bring: with data parallelism's copies, only
        # the items that lack places (store/coverage.py), not shards of this rank's size.
        arrivals = Arrivals(self._store.inventory, self._store.metadata, self._topology,
                            self._replicator.places, owners)
        self._store.capacity.expect_replicas([self.rank], len(owners), arrivals)
        self._room.arriving = arrivals
        transport.sink.accept_from(self._lineage)

    # ------------------------------------------------------------------ DCP-native
    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The process group to pass to ``dcp.save``/``dcp.async_save`` with
        ``storage_writer()``: a gloo group for these saves alone, so that their collectives,
        which ``dcp.async_save`` runs on a thread of its own, never meet the training
        thread's, another save's or the manager's. Made the first time it is read, which
        every rank does at the same point (making a group is collective). None without a
        process group."""
        if self._dcp_pg is None and self._distributed:
            self._dcp_pg = dist.new_group(backend="gloo")
        return self._dcp_pg

    def storage_writer(self, step: int) -> MemoryStorageWriter:
        """A writer for ``dcp.save`` / ``dcp.async_save`` of ``step``; pass
        ``process_group=ckpt.process_group`` with it (``dcp.async_save`` on the default group
        is refused: see docs/integration.md).

        What the save commits is published (history, metadata to every node, replication,
        retention, buffers) at this rank's next call: ``storage_writer``, ``wait`` or
        ``close``. Collective in a run's first save, which sets an earlier run's steps aside
        (``save``).
        """
        self._check_open()
        writer = self._saver.storage_writer(step, self._lineage)
        if self._saver.last_result is not None:
            self._room.after_first_save(self._saver.last_result.step)
        return writer

    def storage_reader(self, step: int) -> MemoryStorageReader:
        """A reader for ``dcp.load`` of an in-memory ``step``."""
        return MemoryStorageReader(step, self._store)

    # ------------------------------------------------------------------ save
    def save(self, state_dict: dict[str, Any], step: int, *, persistent: bool = False) -> SaveResult:
        """Save ``step`` and return once it is committed in tmpfs on every rank. A save that
        fails on any rank raises the same error on every rank, naming the rank and node that
        hit it (docs/operations.md, "What a failed save does"); with ``persistent=True`` the
        persistent step is written all the same, and the error says so. The first save of a run that
        did not ``resume`` sets an earlier run's steps aside in ``orphans/``, with one warning
        (docs/operations.md, "Saving before resume")."""
        self._check_open()
        persist = self._persistent_for(persistent)
        result = self._saver.save(state_dict, step, self._lineage, persist)
        self._room.after_first_save(step)
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
        return self._snapshots.guard(optimizer)

    def wait_staged(self) -> None:
        """Wait until the snapshot of the save in flight is taken: call it before changing a
        guarded optimizer's tensors outside ``optimizer.step()`` (or any tensor, after
        ``async_save(..., overlap=True)``). Raises this rank's staging failure, if any."""
        self._snapshots.wait()

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
        one. The future's result is a SaveResult. A save that fails on any rank (e.g. a
        CapacityError while copying here, or a failed overlapped copy) fails every rank's
        future with the same error, naming the rank and node that hit it; no rank waits for
        another, the previous step stays resumable and the next save is an ordinary one. A
        failed overlapped copy is also raised at this rank's next guard point. With
        ``persistent=True`` the persistent step is written even when the in-memory save fails
        (when a stage failed on any rank, before this returns: one all_gather decides it on
        every rank); the future's error says whether it was. A run's first
        save, without ``resume`` before it, sets an earlier run's steps aside (``save``).
        """
        self._check_open()
        persist = self._persistent_for(persistent)
        future = self._saver.async_save(state_dict, step, self._lineage, persist, overlap)
        self._room.after_first_save(step)
        return future

    # ------------------------------------------------------------------ resume
    def resume(self, state_dict: dict[str, Any], *, announce: bool = True) -> ResumeInfo:
        """Load the newest usable checkpoint into ``state_dict`` (in place); all ranks call it.

        ``state_dict`` is the dict ``async_save`` takes. Its top-level values may be DCP
        ``Stateful`` objects (e.g. a model and its optimizer behind ``get_state_dict`` and
        ``set_state_dict``): as in ``dcp.load``, their ``state_dict()`` is read only when a
        step is loaded, after every rank agreed on it, and ``load_state_dict()`` gets what was
        loaded. A fresh start reads none of them, so it trains as the same program without
        mlcheckpoint; an optimizer's state dict read before its first step would create its
        state (AdamW's ``step`` 1). Tensors elsewhere in the dict are loaded in place, other
        values replaced.

        Picks the newest step complete across the surviving nodes (fetching what a replaced
        node lacks from its partner), unless the persistent checkpoint is newer. Copies whose
        checksums fail are refused by all ranks together and the next candidate is tried:
        another copy, an older step, the persistent step, then a fresh start (step None).

        Rank 0 logs what was restored in one line (``ResumeInfo.summary``, logger
        ``mlcheckpoint.recovery.resume``): at INFO, or at WARNING (shown with no logging
        configured) when the job fell back further than a save in flight
        (``ResumeInfo.fell_back``). ``announce=False`` leaves that line to the caller (the
        Lightning strategy prints it through Lightning's own output).
        """
        self._check_open()
        self._saver.wait()
        with self._preemption_waits_for_resume():
            self._remove_abandoned_flushes()
            resumed = self._recovery(announce=announce).run(state_dict)
            self._lineage = resumed.lineage  # later saves descend from what was loaded
            self._saver.settled()
            self._heal_thread = resumed.healing  # a replaced node's own shard, coming back
            if self._flusher is not None:  # a preemption flush waits for what comes back
                self._flusher.after_resume(resumed.healing, resumed.rebuilt_step)
            info = self._last_resume = resumed.info
            history.record(self._store.job_dir, "resume", step=info.step, rank=self.rank,
                           source=info.sources.get(self.rank, info.source),
                           seconds=round(info.seconds, 6), bytes=resumed.bytes_fetched,
                           reason=info.reason)
        return info

    @contextlib.contextmanager
    def _preemption_waits_for_resume(self) -> Iterator[None]:
        """A preemption notice during the resume: the flush waits for the step the resume
        loads (and for what it leaves coming back), and SIGTERM's handler, on the main thread
        that loads it, waits until the resume is over (docs/operations.md, Preemption)."""
        if self._preemption is None or self._flusher is None:
            yield
            return
        # The flusher's block inside: the flush stops waiting before the handler waits for it.
        with self._preemption.handler_after(), self._flusher.resuming():
            yield

    def continue_from(self, step: int | None) -> None:
        """The job continues from ``step`` (None: from scratch), restored without ``resume``:
        e.g. a framework loaded a checkpoint the user named from its own folder. Call it
        instead of ``resume`` on every rank (collective). In-memory steps newer than ``step``
        are dropped on every node, as after a resume: the job saves new ones under their
        numbers, and retention must not keep the abandoned ones as the newest."""
        self._check_open()
        self._saver.wait()
        self._remove_abandoned_flushes()
        self._recovery().continue_from(step)
        self._saver.settled()

    def _remove_abandoned_flushes(self) -> None:
        """Rank 0, before the resume's first collective (no rank of this run flushes until it
        is over): the folders of an earlier run's flushes that never completed go
        (``Flusher.remove_abandoned``)."""
        if self.rank == 0 and self._flusher is not None:
            self._flusher.remove_abandoned(BY_NAME["flush_deadline"].resolve())

    def _recovery(self, announce: bool = False) -> Recovery:
        return Recovery(self._store, self._topology, self._comm, lineage=self._lineage,
                        group=self._save_pg, replicator=self._replicator, persistent=self._persistent,
                        announce=announce)

    # ------------------------------------------------------------------ listing
    def checkpoints(self) -> list[CheckpointEntry]:
        """In-memory steps on this node and persistent steps, oldest first."""
        return list_checkpoints(self._store, self._replicator, self._persistent)

    def protection(self) -> ProtectionStatus:
        """How far replication lags behind the saves: the newest protected step (every shard
        and the metadata on two nodes), its lag in steps and its age in seconds, this rank's
        replication rate, and how many of its saves were skipped. With replication off nothing
        is ever protected."""
        return self._protection(ask=True)

    def _protection(self, ask: bool) -> ProtectionStatus:
        if self._replicator is None:
            return protection_status(None, save_times(self._store.inventory.all()), None, 0)
        return self._replicator.protection(ask)

    def stats(self) -> dict[str, float]:
        """Figures to log beside the loss (TensorBoard, W&B, any logger): the last committed
        save's seconds, phases (``stage``, ``commit``, ``publish``), the training thread's
        wait and bytes; the longest a guard held ``optimizer.step()``; the newest protected
        step, its lag in steps and age in seconds; how many nodes keep data parallelism's
        copies and the shard bytes they spared replication; the in-memory saves that failed
        (``failed_saves``, ``failed_saves_in_a_row``); where replication's time went
        (``replication_*``: bytes and seconds sending, held back by the budget, receiving,
        verifying, committing, summed); the last resume's seconds, phases and
        the copies it refused (``resume_refused_copies``). Keys
        start with ``mlcheckpoint/``; a figure not known yet is left out. Reads this node's
        step list and asks the c10d store nothing: fine to call on the training thread."""
        return metrics.stats(
            self._saver.last_result, self._protection(ask=False), self._last_resume,
            guard_longest_wait=self._snapshots.longest_wait_s,
            copy_modes=self._saver.copy_modes(),
            skipped_bytes=None if self._replicator is None else self._replicator.skipped_bytes,
            save_failures=self._saver.failures.total,
            save_failures_in_a_row=self._saver.failures.streak,
            replication=None if self._replicator is None else self._replicator.profile())

    def replication_state(self, step: int) -> StepReplication | None:
        """What this rank knows of its push of ``step`` to its partners: its ``state``
        ("committed", "replicated", "failed" or "superseded"), ``bytes``, ``seconds``,
        ``attempts``, ``reason``. None with replication off or for a step it never saw."""
        return None if self._replicator is None else self._replicator.state(step)

    def wait_replicated(self, step: int, timeout: float | None = None) -> bool:
        """Wait until every shard and the metadata of ``step`` are on two nodes (job-wide).

        Returns False after ``timeout`` seconds (default ``Timeouts.close``, 60). With
        replication off, returns whether the step is complete locally (there is nothing more
        to wait for).
        """
        if self._replicator is None:
            return step in self._store.inventory.complete_steps()
        return self._replicator.wait_replicated(
            step, self._timeouts.close if timeout is None else timeout)

    # ------------------------------------------------------------------ lifecycle
    def wait(self) -> None:
        """Block until every save, persistent write and post-resume repair has finished."""
        self._saver.wait()
        if self._heal_thread is not None:
            self._heal_thread.join()
        if self._persistent_writer is not None:
            self._persistent_writer.wait()  # raises the first failed write not raised yet

    def close(self, failed: bool | None = None, *, timeout: float | None = None) -> None:
        """Wait for saves and replication in flight, then release threads, sockets and
        mappings. Idempotent.

        When the job ends normally this is collective: every rank calls it, and each waits at
        most ``timeout`` seconds (default ``Timeouts.close``, 60) for the others (partners may
        still be pushing replicas to it) before closing anyway. When the job is failing it waits for no other rank and no
        collective work in flight, so a rank that raised exits at once instead of being held by
        ranks that will never come. Failing means ``failed=True``, or, by default, that close is
        called while an exception is being handled (from an ``except`` block, as torchtitan's
        trainer does, or from ``with`` on an error).

        A close that completes without an error marks the job finished on each node
        (``finished.json``, until a run claims the directory again): see docs/operations.md,
        "A finished job's memory".
        """
        if self._closed:
            return
        if failed is None:
            failed = sys.exc_info()[1] is not None
        if timeout is None:
            timeout = self._timeouts.close
        try:
            if failed:
                log.warning("mlcheckpoint: closing after an error on this rank: not waiting for "
                            "other ranks or for saves in flight")
            else:
                # A failed persistent write was logged where it happened: close goes on.
                with contextlib.suppress(Exception):
                    self.wait()
                if self._replicator is not None:
                    self._replicator.drain(timeout=timeout)
                if self._distributed:
                    # Partners may still push to our listener: close only once everyone drained.
                    self._barrier(timeout)
                if self._replicator is not None:  # the last round has no next one to close it:
                    with contextlib.suppress(Exception):  # history learns of it here
                        self._replicator.newest_protected()
                self._mark_finished()
        finally:
            self._release(wait=not failed)

    def _mark_finished(self) -> None:
        """A clean close: this node's memory of the job becomes a finished job's (the memory a
        new job's room check names as the first to reclaim, and no other job's resume names
        as one it may have meant; docs/operations.md, "A finished job's memory") until a run
        claims the directory again."""
        if self._topology.is_node_leader:
            with contextlib.suppress(OSError):
                mark_finished(self._store.paths, self._lineage.run_id,
                              max(self._store.inventory.complete_steps(), default=None))

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
        if self._preemption is not None:  # SIGTERM's handling as it was before the manager
            self._preemption.close()
        self._lifecycle.warmer.stop()  # a save finishing now prepares no more buffers
        # Not waiting: a snapshot in flight fails rather than commits what training changes.
        self._snapshots.close(wait=wait)
        idle = self._saver.close(wait)
        if self._persistent_writer is not None:
            idle = self._persistent_writer.close(wait) and idle
        # Waited for even in a failing close: local work of bounded length, and the claim is
        # released below, after which the next run may take the directory it writes into.
        idle = self._lifecycle.warmer.close(wait=True) and idle
        if self._replicator is not None:
            self._replicator.close()
            # Its session threads write received replicas into the store's mappings.
            idle = self._replicator.transport.close() and idle
        if idle and not (self._heal_thread is not None and self._heal_thread.is_alive()):
            # Else (a failing close) work still running uses these mappings: they go with the
            # process.
            self._store.close()
        # This run starts nothing more here, also after a failing close: the next run (a
        # restart in this process included) may claim the directory.
        self._claim.release()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close(failed=exc_type is not None)

    def _check_open(self) -> None:
        if self._closed:
            raise MLCheckpointError("CheckpointManager is closed")

    def prune_persistent(self, later: bool = False) -> None:
        """Remove the persistent steps beyond ``keep_persistent`` (rank 0; the newest complete
        step and one being written stay): for a framework that writes its own persistent
        checkpoints, after each. ``later``: on the writer's thread, after the writes queued."""
        if self._persistent_writer is not None:
            if later:
                self._persistent_writer.prune_later()
            else:
                self._persistent_writer.prune()

    def _persistent_for(self, persistent: bool) -> PersistentWriter | None:
        """The writer a save with ``persistent`` uses (None: no persistent write). Refused at
        the call, before anything is staged or pinned, when there is no persistent folder."""
        if not persistent:
            return None
        if self._persistent_writer is None:
            raise ConfigError("persistent=True needs CheckpointManager(persistent_dir=...): "
                              "no persistent folder was given")
        return self._persistent_writer

"""CheckpointManager: what a training loop calls. Ties the store, DCP adapters, replication,
recovery and the persistent fallback together; each public method is a few lines that hand
over to a collaborator built in ``__init__``: ``Saver`` (saving.py, the save path),
``PersistentWriter`` (persistent_writer.py), ``Recovery`` (recovery/), ``Lifecycle``
(lifecycle.py: pins, retention, buffer warming), ``Replicator`` (replication/).

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
from concurrent.futures import Future
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from typing_extensions import Self

from . import history, metrics
from .dcp import MemoryStorageReader, MemoryStorageWriter
from .dcp.snapshot import GuardHandle, Snapshotter
from .errors import ConfigError, MLCheckpointError
from .lifecycle import Lifecycle
from .listing import CheckpointEntry, list_checkpoints
from .persistent import PersistentStorage, open_persistent
from .persistent_writer import PersistentWriter
from .recovery import Recovery, ResumeInfo
from .recovery.resume import Comm
from .replication import ReceiveSink, Rendezvous, Replicator, network
from .replication.factory import make_transport
from .replication.lag import ProtectionStatus, save_times
from .replication.lag import status as protection_status
from .replication.pairing import pairing_for
from .room import RoomCheck
from .saving import Saver, SaveResult
from .settings import Launcher, Options, Timeouts, default, tuning
from .store import LocalStore
from .store.identity import Lineage, new_id
from .topology import Topology

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
        replication: "tcp", "pg" (gloo), "nccl" (GPU buffers over NCCL) or "none". Off by
            itself on a single node.
        replication_host: address the TCP listener binds and advertises (default: that of
            ``replication_interface``, else the one routing to MASTER_ADDR; env
            MLCHECKPOINT_REPLICATION_HOST).
        replication_timeout: seconds any single replication socket operation may block.
        replication_streams: TCP connections one large shard is pushed over (default
            ``$MLCHECKPOINT_TCP_STREAMS`` or 4; each stream carries at least 64 MiB).
        replication_bandwidth: bytes per second replication may send in the background, for
            the whole node (its ranks share it): an int or a string such as "100MB/s" or
            "1Gbit"; 0 or "none" for no cap (default ``$MLCHECKPOINT_REPLICATION_BANDWIDTH``
            or "auto": a share of the interface's speed, see docs/operations.md). A resume's
            own reads are never capped.
        replication_interface: network interface (e.g. "eth1", "ib0") whose IPv4 address the
            TCP listener binds and advertises to the other nodes (default
            ``$MLCHECKPOINT_REPLICATION_IFNAME``; with ``replication_host``, both must agree).
        failure_domain: what fails together with this node: a rack, a switch, a power feed
            (default ``$MLCHECKPOINT_FAILURE_DOMAIN``, else the leaf switch SLURM's topology
            plugin names). Partners are then chosen in other domains (docs/operations.md).
        replicas: partner nodes that keep a replica of each shard, 1-8 (default
            ``$MLCHECKPOINT_REPLICAS`` or 1), in distinct failure domains where possible:
            losing any ``replicas`` nodes resumes from memory. Each node keeps that many other
            nodes' shards beside its own (docs/operations.md, "More than one partner"). Rank
            0's value holds for the job.
    """

    def __init__(self, persistent_dir: str | PersistentStorage | None = None, *,
                 job_id: str | None = None, local_dir: str | None = None,
                 keep: int = default("keep"), keep_persistent: int | None = None,
                 memory_limit_bytes: int | str | None = None,
                 replication: str = default("replication"), replication_host: str | None = None,
                 replication_timeout: float = default("replication_timeout"),
                 replication_streams: int | None = None,
                 replication_bandwidth: int | str | None = None,
                 replication_interface: str | None = None, failure_domain: str | None = None,
                 replicas: int | None = None):
        self.persistent = open_persistent(persistent_dir)
        # Every argument and variable, resolved and checked before anything is written
        # (settings.py declares them). Plain torchrun gives no job id: the persistent folder,
        # which a restart keeps, names one.
        self.options = opts = Options.resolve(
            job_id=job_id, local_dir=local_dir, keep=keep, keep_persistent=keep_persistent,
            memory_limit_bytes=memory_limit_bytes,
            replication=replication, replication_host=replication_host,
            replication_timeout=replication_timeout, replication_streams=replication_streams,
            replication_bandwidth=replication_bandwidth,
            replication_interface=replication_interface, failure_domain=failure_domain,
            replicas=replicas, derive_job_id_from=None if self.persistent is None else self.persistent.location)
        network.check_listen_settings(opts.replication_host, opts.replication_interface,
                                      host_given=replication_host is not None,
                                      interface_given=replication_interface is not None)
        replication = opts.replication
        self.launcher = Launcher.from_env()
        self.timeouts = Timeouts(replication=opts.replication_timeout)
        self.topology = Topology.detect(self.launcher)
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
        # resume extends it with the run it loaded from (see store/identity.py). The same
        # collective agrees every node's failure domain and rank 0's replica count (the
        # pairing follows them).
        agreed = self._all_gather((new_id(), opts.failure_domain, opts.replicas))
        self.lineage = Lineage(agreed[0][0])
        self.replicas: int = agreed[0][2]
        self.topology = self.topology.with_domains([domain for _, domain, _ in agreed])
        self.snapshots = Snapshotter(predict_plans=self.topology.world_size > 1)  # staging thread, guards
        self.lifecycle = Lifecycle(self.store, self.rank, self.keep)
        self.pins = self.lifecycle.pins  # steps whose buffers a transfer or persistent write reads
        self.retention = self.lifecycle.retention
        self.warmer = self.lifecycle.warmer  # buffers of the next saves
        self.persistent_writer = None if self.persistent is None else PersistentWriter(
            self.persistent, job_dir=self.store.job_dir, rank=self.rank,
            group=self._persist_pg, pins=self.pins, retention=self.retention,
            keep=opts.keep_persistent)
        self._closed = False
        self.replicator: Replicator | None = None
        self.replica_owners: list[int] = []
        self._heal_thread: threading.Thread | None = None
        self.last_resume: ResumeInfo | None = None  # what this manager's resume() loaded
        if replication != "none" and self.topology.num_nodes == 1:
            log.info("mlcheckpoint: single node, replication off (nothing to pair with)")
            replication = "none"
        if replication != "none" and not self._distributed:
            log.info("mlcheckpoint: no process group initialised, replication off")
            replication = "none"
        self.replication_mode = replication
        self.room = RoomCheck(self.store.local_dir, self.store.paths, self.topology, self.keep,
                              replica_sets=self.replicas if replication != "none" else 0)
        self.room.at_start()  # a container's small /dev/shm: say so now, not at a failed save
        if replication != "none":
            self._start_replication(replication, opts)
        self.saver = Saver(self.store, self.topology, group=self._save_pg,
                           snapshots=self.snapshots, retention=self.retention,
                           warmer=self.warmer, replicator=self.replicator,
                           all_gather=self._all_gather)
        log.debug("CheckpointManager job=%s dir=%s rank=%d/%d node=%d/%d", self.job_id,
                  self.store.job_dir, self.rank, self.topology.world_size,
                  self.topology.node_rank, self.topology.num_nodes)

    def _start_replication(self, mode: str, opts: Options) -> None:
        # The replication secret is agreed over our own gloo group, never the c10d store.
        rdzv = Rendezvous.from_default_group(self.job_id, self.timeouts.rendezvous,
                                             group=self._save_pg,
                                             generation=self.launcher.restart_count)
        sink = ReceiveSink(self.store, pins=self.pins, subscribers=[self.lifecycle.replica_received])
        transport = make_transport(mode, self.store, rdzv, sink, host=opts.replication_host,
                                   interface=opts.replication_interface,
                                   timeout=self.timeouts.replication,
                                   handshake_timeout=self.timeouts.handshake,
                                   min_stripe_bytes=tuning().min_stripe_bytes,
                                   mailbox_poll=self.timeouts.mailbox_poll,
                                   streams=opts.replication_streams,
                                   bandwidth=opts.replication_bandwidth, topology=self.topology)
        self.replicator = Replicator(self.store, transport, rdzv, self.topology,
                                     poll_interval=self.timeouts.replicator_poll,
                                     wait_poll=self.timeouts.wait_poll,
                                     strategy=pairing_for(self.topology.domains, self.replicas))
        self.replica_owners = self.replicator.sources
        self.retention.protect_replicas(self.replicator, self.replica_owners)
        self.store.capacity.expect_replicas([self.rank], len(self.replica_owners))
        transport.accept_from(self.lineage)

    # ------------------------------------------------------------------ DCP-native
    def storage_writer(self, step: int) -> MemoryStorageWriter:
        """A writer for ``dcp.save`` / ``dcp.async_save`` of ``step``.

        Retires this rank's checkpoints beyond ``keep`` first, so their buffers are reused.
        Collective in a run's first save, which sets an earlier run's steps aside (``save``).
        """
        self._check_open()
        self.saver.set_aside_earlier_runs(step, self.lineage)
        # save/async_save retire old steps after each save, on the background thread, so they
        # skip this up-front retention (an inventory and c10d round trips on the training thread).
        self.retention.apply()
        return self.saver.storage_writer(step, self.lineage)

    def storage_reader(self, step: int) -> MemoryStorageReader:
        """A reader for ``dcp.load`` of an in-memory ``step``."""
        return MemoryStorageReader(step, self.store)

    # ------------------------------------------------------------------ save
    def save(self, state_dict: dict[str, Any], step: int, *, persistent: bool = False) -> SaveResult:
        """Save ``step`` and return once it is committed in tmpfs on every rank. The first save
        of a run that did not ``resume`` sets an earlier run's steps aside in ``orphans/``, with
        one warning (docs/operations.md, "Saving before resume")."""
        self._check_open()
        persist = self._persistent_for(persistent)
        result = self.saver.save(state_dict, step, self.lineage, persist)
        self.room.after_first_save(step)
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
        step fail too (no rank waits for it) and the previous step stays resumable. A run's
        first save, without ``resume`` before it, sets an earlier run's steps aside (``save``).
        """
        self._check_open()
        persist = self._persistent_for(persistent)
        future = self.saver.async_save(state_dict, step, self.lineage, persist, overlap)
        self.room.after_first_save(step)
        return future

    # ------------------------------------------------------------------ resume
    def resume(self, state_dict: dict[str, Any]) -> ResumeInfo:
        """Load the newest usable checkpoint into ``state_dict`` (in place); all ranks call it.

        Picks the newest step complete across the surviving nodes (fetching what a replaced
        node lacks from its partner), unless the persistent checkpoint is newer. Copies whose
        checksums fail are refused by all ranks together and the next candidate is tried:
        another copy, an older step, the persistent step, then a fresh start (step None).
        """
        self._check_open()
        self.saver.wait()
        resumed = self._recovery().run(state_dict)
        self.lineage = resumed.lineage  # later saves descend from what was loaded
        self.saver.settled()
        self._heal_thread = resumed.healing  # a replaced node's own shard, coming back
        info = self.last_resume = resumed.info
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
        self.saver.wait()
        self._recovery().continue_from(step)
        self.saver.settled()

    def _recovery(self) -> Recovery:
        return Recovery(self.store, self.topology, Comm(self._all_gather), lineage=self.lineage,
                        group=self._save_pg, replicator=self.replicator, persistent=self.persistent)

    # ------------------------------------------------------------------ listing
    def checkpoints(self) -> list[CheckpointEntry]:
        """In-memory steps on this node and persistent steps, oldest first."""
        return list_checkpoints(self.store, self.replicator, self.persistent)

    def protection(self) -> ProtectionStatus:
        """How far replication lags behind the saves: the newest protected step (every shard
        and the metadata on two nodes), its lag in steps and its age in seconds, this rank's
        replication rate, and how many of its saves were skipped. With replication off nothing
        is ever protected."""
        return self._protection(ask=True)

    def _protection(self, ask: bool) -> ProtectionStatus:
        if self.replicator is None:
            return protection_status(None, save_times(self.store.inventory()), None, 0)
        return self.replicator.protection(ask)

    def stats(self) -> dict[str, float]:
        """Figures to log beside the loss (TensorBoard, W&B, any logger): the last committed
        save's seconds, phases (``stage``, ``commit``, ``publish``), the training thread's
        wait and bytes; the newest protected step, its lag in steps and age in seconds; the
        last resume's seconds and phases. Keys start with ``mlcheckpoint/``; a figure not
        known yet is left out. Reads this node's step list and asks the c10d store nothing
        (the protected step is the newest one known at the last save): fine to call on the
        training thread every step."""
        return metrics.stats(self.saver.last_result, self._protection(ask=False),
                             self.last_resume, self.saver.copy_modes(), self.replicator)

    def wait_replicated(self, step: int, timeout: float | None = None) -> bool:
        """Wait until every shard and the metadata of ``step`` are on two nodes (job-wide).

        Returns False after ``timeout`` seconds (default ``Timeouts.close``, 60). With
        replication off, returns whether the step is complete locally (there is nothing more
        to wait for).
        """
        if self.replicator is None:
            return step in self.store.complete_steps()
        return self.replicator.wait_replicated(
            step, self.timeouts.close if timeout is None else timeout)

    # ------------------------------------------------------------------ lifecycle
    def wait(self) -> None:
        """Block until every save, persistent write and post-resume repair has finished."""
        self.saver.wait()
        if self._heal_thread is not None:
            self._heal_thread.join()
        if self.persistent_writer is not None:
            self.persistent_writer.wait()  # raises the first failed write not raised yet

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
        """
        if self._closed:
            return
        if failed is None:
            failed = sys.exc_info()[1] is not None
        if timeout is None:
            timeout = self.timeouts.close
        try:
            if failed:
                log.warning("mlcheckpoint: closing after an error on this rank: not waiting for "
                            "other ranks or for saves in flight")
            else:
                # A failed persistent write was logged where it happened: close goes on.
                with contextlib.suppress(Exception):
                    self.wait()
                if self.replicator is not None:
                    self.replicator.drain(timeout=timeout)
                if self._distributed:
                    # Partners may still push to our listener: close only once everyone drained.
                    self._barrier(timeout)
                if self.replicator is not None:  # the last round has no next one to close it:
                    with contextlib.suppress(Exception):  # history learns of it here
                        self.replicator.newest_protected(self.store.steps())
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
        self.warmer.stop()  # a save finishing now prepares no more buffers
        # Not waiting: a snapshot in flight fails rather than commits what training changes.
        self.snapshots.close(wait=wait)
        idle = self.saver.close(wait)
        if self.persistent_writer is not None:
            idle = self.persistent_writer.close(wait) and idle
        idle = self.warmer.close(wait) and idle
        if self.replicator is not None:
            self.replicator.close()
            # Its session threads write received replicas into the store's mappings.
            idle = self.replicator.transport.close() and idle
        if idle and not (self._heal_thread is not None and self._heal_thread.is_alive()):
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

    def _persistent_for(self, persistent: bool) -> PersistentWriter | None:
        """The writer a save with ``persistent`` uses (None: no persistent write). Refused at
        the call, before anything is staged or pinned, when there is no persistent folder."""
        if not persistent:
            return None
        if self.persistent_writer is None:
            raise ConfigError("persistent=True needs CheckpointManager(persistent_dir=...): "
                              "no persistent folder was given")
        return self.persistent_writer

    # ------------------------------------------------------------------ collectives
    def _all_gather(self, obj: Any) -> list[Any]:
        if not self._distributed:
            return [obj]
        out: list[Any] = [None] * dist.get_world_size(self._save_pg)
        dist.all_gather_object(out, obj, group=self._save_pg)
        return out


"""Saver: the save path behind ``CheckpointManager.save`` and ``async_save``, in three phases,
and the publish path after every commit, DCP-native saves' included.

    stage    copy the state dict into this rank's tmpfs buffer, with checksums
             (``dcp/staging.py``; an overlapped stage finishes on the staging thread). It
             hands one value, a ``Staged``, to the commit. A blocking ``save`` stages inside
             the commit instead: ``write_data`` copies what DCP's plan gives this rank.
    commit   ``dcp.save`` through a ``MemoryStorageWriter``: every rank's ``write_data``
             commits its shard (the manifest rename), the coordinator the global metadata.
    publish  once the save is committed on this rank (``_publish``, one path for both
             routes): the history record, its metadata on every node, the replicator told
             (once, of this save), retention, the next buffers, ``last_result``.

``async_save`` stages on the calling thread, then commits and publishes on the save thread.
At most one in-memory save is in flight. The persistent write, if asked, follows publish, and
is made also when the in-memory save fails (every rank alike: ``_failed_anywhere`` at the call
for a stage that failed, ``_commit``'s ``on_failure`` for a commit that did): the tiers never
fail together. ``SaveFailures`` logs the first failure of a run of them and counts the rest.

A DCP-native save (``storage_writer``: the user's ``dcp.save``/``dcp.async_save`` drives the
writer) stages and commits in DCP's hands, on DCP's thread or, in PROCESS mode, in DCP's
checkpoint process, and DCP returns the global metadata to its caller, not to the writer. So
the Saver publishes it at its next call on this rank (the next ``storage_writer``, a save,
``wait``, ``close``), from what the writer, or else the store, shows was committed: the same
``_publish``, with the metadata only where this rank holds it (the coordinator's writer, which
committed it in ``finish``); rank 0's replicator sends it to the other nodes.

A run's first save, unless it resumed (``settled``), first sets aside the steps an earlier run
of the job left in memory (``set_aside_earlier_runs``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict_saver import _stateful_to_state_dict

from .. import history
from .._gc import gc_paused
from .._messages import plural
from ..dcp import MemoryStorageWriter, staging
from ..dcp.copies import CopyPolicy
from ..dcp.errors import save_failure
from ..dcp.snapshot import Snapshotter
from ..dcp.staging import Staged
from ..dcp.writer import commit_metadata
from ..errors import MLCheckpointError
from ..replication import Replicator
from ..replication.schedule.pairing import every_source
from ..store import LocalStore
from ..store.identity import Lineage
from ..tmpfs import step_room
from ..topology import Topology
from .lifecycle import BufferWarmer, Retention
from .persistent_writer import PersistentWriter

log = logging.getLogger(__name__)


@dataclass
class SaveResult:
    step: int
    bytes: int
    blocking_seconds: float  # time the caller was held (staging for async_save)
    seconds: float  # until committed in tmpfs on every rank: phases "stage" + "commit"
    persistent: bool = False
    overlapped_bytes: int = 0  # copied on the staging thread while training went on
    # Seconds per phase (see the module docstring): "stage" (the copy into tmpfs: inside
    # write_data for a blocking save; for async_save until every byte is in place, also on
    # the staging thread), "commit" (the rest of dcp.save: write_data through the manifest
    # rename, on every rank, and the metadata) and "publish" (the metadata on every node, the
    # replicator, retention). The persistent write is not in any of them.
    phases: dict[str, float] = field(default_factory=dict)
    # Tensor bytes copied into tmpfs before DCP planned the save (async_save's stage; 0 for
    # ``save``, which copies only what the plan gives this rank). Following the previous
    # step's plan (dcp/plans.py), an overlapped stage copies only this rank's items.
    staged_bytes: int = 0
    # Bytes of this rank's save that the host copied or hashed. Tensors in device memory add
    # none: they are copied by DMA and checksummed on the device (dcp/device_staging.py).
    host_bytes: int = 0


@dataclass(frozen=True)
class Committed:
    """A save committed on this rank, as the publish path takes it from either route."""

    result: SaveResult
    save_id: str
    lineage: Lineage
    metadata: Metadata | None  # the step's global metadata, where this rank holds it
    # Every rank holds the metadata (``dcp.save`` returned it to each): no node needs it
    # sent. False for a DCP-native save, whose metadata only the coordinator's writer saw.
    metadata_everywhere: bool
    copy_modes: tuple[str, ...] = ()  # each node's copies mode, as the metadata header records


@dataclass
class _NativeSave:
    """A writer ``storage_writer`` handed out, until what DCP committed with it is published."""

    writer: MemoryStorageWriter
    made: float  # time.time() when handed out (manifests carry their commit's)
    earlier_save: str | None  # this rank's shard of the step already here then: not this save


class Saver:
    """Saves steps of one CheckpointManager into ``store``; collective over ``group``.

    Args:
        store, topology: this node's store and where this rank sits in the job.
        group: the in-memory saves' process group (one rank per job rank).
        snapshots: the staging thread and guards of overlapped saves.
        retention: applied after every save.
        warmer: prepares the buffers of the next saves.
        replicator: told of every save once it is committed; None with replication off.
        all_gather: the job-wide all_gather of the checkpoint group (the manager's).
    """

    def __init__(self, store: LocalStore, topology: Topology, *, group: dist.ProcessGroup | None,
                 snapshots: Snapshotter, retention: Retention, warmer: BufferWarmer,
                 replicator: Replicator | None, all_gather: Callable[[Any], list[Any]],
                 keep_copies: bool = True):
        self.store = store
        self.topology = topology
        self.group = group
        self.snapshots = snapshots
        self.retention = retention
        self.warmer = warmer
        self.replicator = replicator
        self._all_gather = all_gather
        # Replicating: keep data parallelism's copies (dcp/copies.py), which it need not send
        # (unless ReplicationOptions.copies is "off").
        # What arrives counts against a node's room as the room check counts it: the
        # pairing's sources and places (failure domains) go with the policy.
        self.copy_policy = None if replicator is None or not keep_copies else CopyPolicy(
            tuple(map(topology.node_of, range(topology.world_size))),
            functools.partial(step_room, store.local_dir, store.memory_limit_bytes,
                              retention.keep),
            sources=tuple(map(tuple, every_source(replicator.strategy, topology.num_nodes))),
            replicas=replicator.places - 1,
            place_of_node=tuple(map(topology.place_of_node, range(topology.num_nodes))))
        self._settled = False  # resumed, or the earlier runs' steps set aside: see settled()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="mlckpt-save")
        self._lock = threading.Lock()
        self._in_flight: Future[SaveResult] | None = None
        self._native: list[_NativeSave] = []  # DCP-native saves not published yet, oldest first
        self.last_result: SaveResult | None = None  # the newest save published (for stats())
        self.failures = SaveFailures(topology.rank)  # failed in-memory saves (for stats())

    # ------------------------------------------------------------------ the two saves
    def save(self, state_dict: dict[str, Any], step: int, lineage: Lineage,
             persist: PersistentWriter | None) -> SaveResult:
        """Save ``step`` and return once it is committed on every rank (and, with ``persist``,
        written to the persistent folder)."""
        self._before_save(step, lineage)
        writer = self._writer(step, lineage)
        t0 = time.perf_counter()

        def persist_instead(error: BaseException) -> None:  # the caller's state is still as saved
            assert persist is not None
            self._persist_after_failure(error, persist, state_dict, step, lineage)

        try:  # (stages inside write_data)
            metadata = self._commit(writer, state_dict, "save",
                                    None if persist is None else persist_instead)
        except Exception as e:
            self.failures.failed(step, e)
            raise
        seconds = time.perf_counter() - t0
        result = SaveResult(step, _committed_bytes(writer), seconds, seconds, persist is not None,
                            phases={"stage": writer.copy_seconds,
                                    "commit": seconds - writer.copy_seconds},
                            host_bytes=writer.host_bytes)
        self._publish(Committed(result, writer.save_id, writer.lineage, metadata, True,
                                writer.copy_modes()))
        if persist is not None:
            persist.write(state_dict, step, lineage)
        return result

    def async_save(self, state_dict: dict[str, Any], step: int, lineage: Lineage,
                   persist: PersistentWriter | None, overlap: bool | None) -> Future[SaveResult]:
        """Stage ``state_dict`` (see ``CheckpointManager.async_save``), then commit and publish
        on the save thread."""
        self._before_save(step, lineage)
        overlapped = self.snapshots.guarded if overlap is None else overlap
        t0 = time.perf_counter()
        # A persistent write reads the staged views after the commit: stage every tensor
        # then, and commit the staged region whole.
        staged = self._stage(state_dict, step, overlapped, overlap, leave_out=persist is None)
        persisted = None  # what became of the persistent step, when the save fails at the stage
        if persist is not None and self._failed_anywhere(staged.failure is not None):
            # The commit will fail on every rank (a rank's stage failed): the persistent step
            # asked for is written now, from the state dict, before the caller changes it.
            persisted = _persisted_note(step, persist.write_now(state_dict, step, lineage))
            persist = None
        blocking = time.perf_counter() - t0
        # A stage that failed here still goes to the commit, which fails the step on every
        # rank with this rank's error: every rank's future says so, and no rank waits for this
        # one. (Raising it here, on this rank alone, would leave the ranks' calls out of step.)
        writer = self._writer(step, lineage, staged)
        writer.keep_staged = persist is not None
        fut = self._executor.submit(self._commit_and_publish, writer, staged, persist, t0,
                                    blocking, persisted)
        with self._lock:
            self._in_flight = fut
        return fut

    def storage_writer(self, step: int, lineage: Lineage) -> MemoryStorageWriter:
        """A writer for a DCP-native save of ``step`` (``CheckpointManager.storage_writer``).

        DCP drives it, not this Saver: what it commits is published at this Saver's next call
        on this rank (see the module docstring). Before that, as for a save: the earlier
        DCP-native saves are published, and a run's first save sets an earlier run's steps
        aside (collective)."""
        self._before_save(step, lineage)
        writer = self._writer(step, lineage, refuse_default_group=True)
        if self.copy_policy is not None:  # (a writer pickled into DCP's checkpoint process
            self.copy_policy.modes.seen(self.copy_modes())  # logs only a change of modes)
        self._native.append(_NativeSave(writer, time.time(), self._shard_save_here(step)))
        if self.replicator is not None:
            self.replicator.activate()
        return writer

    def copy_modes(self) -> tuple[str, ...]:
        """Each node's mode at the newest save whose metadata is here (``dcp/copies.py``), as
        its header records it: in DCP's PROCESS mode the writer that learnt them ran in
        another process. () without copies."""
        if self.copy_policy is None:
            return ()
        inventory = self.store.inventory.all()
        for step in sorted(inventory, reverse=True):
            if inventory[step].copy_modes:
                return inventory[step].copy_modes
        return self.copy_policy.modes.modes

    # ------------------------------------------------------------------ a run's first save
    def settled(self) -> None:
        """The job's history is settled for this run (``resume`` or ``continue_from`` ran, and
        dropped what did not belong to it): saves set nothing aside."""
        self._settled = True

    def set_aside_earlier_runs(self, step: int, lineage: Lineage) -> None:
        """Before the first save of a run that never resumed: every node sets aside, in
        ``orphans/``, the steps an earlier run of the job left in memory (its own shards and
        replicas alike), so that neither retention (which keeps the numerically newest steps)
        nor a later resume takes them for this run's. Nothing is deleted. Collective: every
        rank makes its first save at the same point, and no rank stages before every node is
        done. One WARNING, from rank 0, names what went where."""
        if self._settled:
            return
        topo = self.topology
        mine: list[int] = []
        error = None
        if topo.is_node_leader:
            try:
                mine = self.store.set_aside_runs(lineage)
            except (OSError, MLCheckpointError) as e:
                error = f"node {topo.node_rank}: {e}"
        gathered = self._all_gather((topo.node_rank, mine, error))
        errors = [e for _, _, e in gathered if e]
        if errors:  # every rank alike: the earlier steps would win retention, so no save yet
            raise MLCheckpointError(
                f"before saving step {step}, the first save of this run, the steps an earlier "
                f"run left in memory could not be set aside ({'; '.join(errors)}); call "
                "resume() before saving to continue from them, or remove them")
        self._settled = True
        if mine:
            history.record(self.store.job_dir, "set_aside", step=step, steps=mine, rank=topo.rank)
        moved = {node: steps for node, steps, _ in gathered if steps}
        if moved and topo.rank == 0:
            where = "; ".join(f"node {n}: {_steps_text(s)}" for n, s in sorted(moved.items()))
            log.warning(
                "mlcheckpoint: step %d is the first save of this run, which did not call "
                "resume(); memory held steps of an earlier run of job %s (%s). They are set "
                "aside in %s, not deleted: neither retention nor a later resume will take them "
                "for this run's, and they are removed once this run has a newer complete step. "
                "To continue from them instead, call resume(state_dict) before the first save.",
                step, self.store.job_id, where, self.store.paths.orphans_dir)

    # ------------------------------------------------------------------ the phases
    def _before_save(self, step: int, lineage: Lineage) -> None:
        """Wait for the save in flight (whose failure its own future reports, on every rank:
        this save goes ahead either way, on every rank alike). A run's first save sets an
        earlier run's steps aside."""
        self.wait()
        self.set_aside_earlier_runs(step, lineage)

    def _stage(self, state_dict: dict[str, Any], step: int, overlapped: bool,
               overlap: bool | None, leave_out: bool) -> Staged:
        """Stage ``state_dict``, following the prediction of DCP's plan (``dcp/plans.py``):
        an overlapped stage (with ``leave_out``) copies only the tensors this rank is to
        write; any other puts the rest last, for the commit to cut off."""
        rank = self.topology.rank
        try:
            with gc_paused():
                flat = _stateful_to_state_dict(state_dict)  # Stateful objects: at call time
                prediction = self.snapshots.plans.predict(flat)
                if not overlapped:
                    return staging.stage_now(self.store, step, rank, flat, prediction)
                deferrable = None if overlap else self.snapshots.deferrable()
                return staging.stage_overlapped(self.store, step, rank, flat, self.snapshots,
                                                deferrable, prediction, leave_out)
        except Exception as e:  # noqa: BLE001  (a Stateful's state_dict() may raise anything)
            # Failed on this rank alone: the commit fails the step on every rank with it.
            return Staged.failed(step, rank, e)

    def _commit_and_publish(self, writer: MemoryStorageWriter, staged: Staged,
                            persist: PersistentWriter | None, t0: float, blocking: float,
                            persisted: str | None = None) -> SaveResult:
        """The save thread's part of ``async_save``. ``persisted``: what became of the
        persistent step, already written because the stage failed on some rank."""
        views = staged.result()  # an overlapped stage: every byte in place (or its error)

        def persist_instead(error: BaseException) -> None:  # before the staged buffer goes back
            assert persist is not None
            if self._failed_anywhere(staged.error() is not None):  # a snapshot is not exact
                note = (f"its persistent checkpoint was not written: the snapshot of step "
                        f"{writer.step} failed on some rank")
                log.error("mlcheckpoint: %s", note)
                _add_note(error, note)
                return
            self._persist_after_failure(error, persist, views, writer.step, writer.lineage)

        try:
            metadata = self._commit(writer, views, "async save",
                                    None if persist is None else persist_instead)
        except Exception as e:
            if persisted:
                _add_note(e, persisted)
            self.failures.failed(writer.step, e)
            raise
        finally:
            staged.release()  # in case write_data never ran here (it releases the guards)
        seconds = time.perf_counter() - t0
        stage_s = staged.staged_at - t0
        result = SaveResult(writer.step, _committed_bytes(writer), blocking, seconds,
                            persist is not None, staged.overlapped_bytes,
                            phases={"stage": stage_s, "commit": seconds - stage_s},
                            staged_bytes=staged.nbytes, host_bytes=writer.host_bytes)
        self._publish(Committed(result, writer.save_id, writer.lineage, metadata, True,
                                writer.copy_modes()))
        if persist is not None:
            persist.submit(views, writer.step, writer.lineage)  # reads the staged views: pins the step
        return result

    def _commit(self, writer: MemoryStorageWriter, state_dict: dict[str, Any], what: str,
                on_failure: Callable[[BaseException], None] | None = None) -> Metadata:
        """``dcp.save``: every rank commits its shard, the coordinator the metadata. A failure
        on any rank (a stage that failed fails DCP's planning) fails it on every rank with
        one error, naming the rank and node that hit it. ``on_failure(error)`` runs on every
        rank alike before the staged buffer goes back (the persistent step written instead)."""
        try:
            with gc_paused():
                return dcp.save(state_dict, storage_writer=writer, process_group=self.group)
        except CheckpointException as e:
            error = save_failure(e, f"{what} of step {writer.step}", self.topology.node_of)
            if on_failure is not None:
                on_failure(error)
            self._drop_failed_shard(writer)
            raise error from None
        finally:
            writer.close()  # a stage the commit never took (its planning failed): its buffer back

    def _failed_anywhere(self, failed_here: bool) -> bool:
        """Whether any rank says it failed (collective on the checkpoint group, which no save
        uses at this point: the one in flight was waited for, or this is its own thread)."""
        return any(self._all_gather(failed_here))

    def _persist_after_failure(self, error: BaseException, persist: PersistentWriter,
                               state_dict: dict[str, Any], step: int, lineage: Lineage) -> None:
        """The in-memory save of ``step`` failed on every rank (``error``): write the
        persistent step asked for from ``state_dict`` (the caller's, or the staged views),
        every rank alike. Whether it was written is added to ``error``, which every rank
        raises; a failed write is also logged (``PersistentWriter.write``) and raised again
        by ``wait``."""
        _add_note(error, _persisted_note(step, persist.write_now(state_dict, step, lineage)))

    def _drop_failed_shard(self, writer: MemoryStorageWriter) -> None:
        """A step that failed on some rank is no checkpoint: give back the space this rank's
        shard of it took (else a CapacityError on one rank leaves the others' shards holding
        the tmpfs for the rest of the run)."""
        if writer.committed is not None:
            with contextlib.suppress(OSError, MLCheckpointError):
                self.store.shards.retire(writer.step, self.topology.rank)

    def _publish(self, saved: Committed) -> None:
        """The one path after every commit, whichever route saved, each part once per save:
        record it, put its metadata on every node, tell the replicator, apply retention,
        prepare the next buffers, and keep its result for ``stats()``."""
        t0 = time.perf_counter()
        result, rank = saved.result, self.topology.rank
        history.record(self.store.job_dir, "save", step=result.step, rank=rank, bytes=result.bytes,
                       seconds=round(result.seconds, 6),
                       blocking_seconds=round(result.blocking_seconds, 6))
        self._metadata_here(saved)
        if self.replicator is not None:
            # Where only the coordinator saw the metadata, rank 0's replicator sends it to the
            # other nodes now, not only when a round names this save.
            self.replicator.notify(result.step, saved.save_id,
                                   share_metadata=not saved.metadata_everywhere)
        self.retention.apply()
        self.warmer.prepare(rank, result.bytes)
        result.phases["publish"] = time.perf_counter() - t0
        self.last_result = result
        self.failures.succeeded(result.step)

    def _metadata_here(self, saved: Committed) -> None:
        """Each node's leader stores the metadata it holds, at once, without waiting for the
        coordinator's push. The coordinator's node (node 0) has it from ``finish``."""
        if (saved.metadata is None or not self.topology.is_node_leader
                or self.topology.node_rank == 0):
            return
        step = saved.result.step
        try:
            self.store.metadata.read(step, saved.save_id)
        except MLCheckpointError:  # none yet, or an earlier save's of this step number
            commit_metadata(self.store, step, saved.metadata, self.topology.world_size,
                            save_id=saved.save_id, lineage=saved.lineage,
                            copy_modes=saved.copy_modes)

    # ------------------------------------------------------------------ DCP-native saves
    def _publish_native(self) -> None:
        """Publish every DCP-native save committed on this rank since the last look, oldest
        first. A writer handed out before one that committed, and not committed itself, is
        dropped: its save failed, or never ran."""
        found = [(i, saved) for i, native in enumerate(self._native)
                 if (saved := self._native_committed(native)) is not None]
        if not found:
            return
        self._native = self._native[found[-1][0] + 1:]
        for _, saved in found:
            self._publish(saved)

    def _native_committed(self, native: _NativeSave) -> Committed | None:
        """What this rank committed with ``native``'s writer: the writer says (it committed
        here), else the store (DCP's PROCESS mode committed in its checkpoint process); None
        if nothing yet. Its ``SaveResult``: ``seconds`` from ``storage_writer`` until this
        rank's shard was committed; ``blocking_seconds`` the ``stage`` of ``dcp.async_save``,
        or all of ``seconds`` for ``dcp.save``; phase "commit" the rest of ``seconds``."""
        writer = native.writer
        manifest = writer.committed
        if manifest is None:
            try:
                manifest = self.store.shards.read_manifest(writer.step, self.topology.rank)
            except MLCheckpointError:  # not committed (yet), or retired
                return None
            if manifest.save_id == native.earlier_save:
                return None
        seconds = max(0.0, manifest.created - native.made)
        staged = writer.stage_seconds > 0  # dcp.async_save staged it; dcp.save held the caller
        stage = writer.stage_seconds if staged else writer.copy_seconds
        result = SaveResult(writer.step, manifest.data_bytes,
                            writer.stage_seconds if staged else seconds, seconds,
                            overlapped_bytes=writer.overlapped_bytes,
                            phases={"stage": stage, "commit": max(0.0, seconds - stage)},
                            staged_bytes=writer.staged_bytes, host_bytes=writer.host_bytes)
        return Committed(result, manifest.save_id, writer.lineage, writer.metadata, False,
                         writer.copy_modes())

    def _shard_save_here(self, step: int) -> str | None:
        """The save id of this rank's committed shard of ``step`` here, if any."""
        try:
            return self.store.shards.read_manifest(step, self.topology.rank).save_id
        except MLCheckpointError:
            return None

    def _writer(self, step: int, lineage: Lineage, staged: Staged | None = None, *,
                refuse_default_group: bool = False) -> MemoryStorageWriter:
        return MemoryStorageWriter(step, self.store, lineage=lineage, snapshots=self.snapshots,
                                   rank=self.topology.rank,
                                   world_size=self.topology.world_size, staged=staged,
                                   copy_policy=self.copy_policy,
                                   refuse_default_group=refuse_default_group)

    # ------------------------------------------------------------------ lifecycle
    def wait(self) -> None:
        """Wait for the save in flight (its error belongs to the caller of ``async_save``),
        then publish the DCP-native saves committed since the last look (the caller waited
        for DCP's futures; one still running is published at a later call)."""
        with self._lock:
            fut = self._in_flight
        if fut is not None:
            fut.exception()
        self._publish_native()

    def close(self, wait: bool) -> bool:
        """Stop the save thread (``wait``: after the save in flight). Returns whether no save
        still runs."""
        self._executor.shutdown(wait=wait, cancel_futures=not wait)
        with self._lock:
            return self._in_flight is None or self._in_flight.done()


class SaveFailures:
    """The in-memory saves of this run that failed, for one log line per streak: the first
    failure of a streak (and a failure of another kind within it) is logged with its cause,
    once for the job (rank 0: every rank raises the same error, ``save_failure``); the rest
    are counted (``stats()``: ``failed_saves``, ``failed_saves_in_a_row``); the first save
    that succeeds after them says so in one line."""

    def __init__(self, rank: int):
        self.rank = rank
        self.total = 0  # failed saves of this run
        self.streak = 0  # failed since the last save that succeeded
        self._first: int | None = None  # the streak's first failed step
        self._kind = ""  # the type of the error last logged
        self._lock = threading.Lock()

    def failed(self, step: int, error: BaseException) -> None:
        with self._lock:
            self.total += 1
            self.streak += 1
            if self.streak == 1:
                self._first = step
            kind, self._kind = self._kind, type(error).__name__
            heard = self.streak > 1 and kind == self._kind
        text = str(error)
        if heard or self.rank != 0:
            log.debug("mlcheckpoint: %s", text)
            return
        log.error("mlcheckpoint: %s (failed saves like it are counted in stats(), "
                  "failed_saves, not logged again until saves succeed)", text)

    def succeeded(self, step: int) -> None:
        with self._lock:
            streak, first, self.streak = self.streak, self._first, 0
            self._kind = ""
        if streak and self.rank == 0:
            log.warning("mlcheckpoint: RAM saves succeed again after %s (failing since step "
                        "%s; step %d saved)", plural(streak, "failure"), first, step)


def _persisted_note(step: int, failure: BaseException | None) -> str:
    """What became of the persistent step written because the in-memory save failed."""
    return (f"step {step}: persistent checkpoint written instead" if failure is None
            else f"step {step}: its persistent checkpoint failed too: {failure}")


def _add_note(error: BaseException, note: str) -> None:
    """``note`` after ``error``'s message (the error every rank raises alike)."""
    if error.args and isinstance(error.args[0], str):
        error.args = (f"{error.args[0]}; {note}", *error.args[1:])
    else:
        error.args = (*error.args, note)


def _steps_text(steps: list[int]) -> str:
    shown = ", ".join(map(str, steps[:8]))
    return f"steps {shown}" + (f" and {len(steps) - 8} more" if len(steps) > 8 else "")


def _committed_bytes(writer: MemoryStorageWriter) -> int:
    return writer.committed.data_bytes if writer.committed is not None else 0

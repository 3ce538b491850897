"""MemoryStorageWriter: a DCP StorageWriter that commits each rank's shard to tmpfs.

Save path: DCP plan (with a ``CopyPolicy``, the coordinator also chooses which ranks keep
copies of items that data parallelism holds on several nodes: ``copies.py``) ->
``write_data`` consumes what staging handed over (``staging.Staged``, if the state dict was
staged) and copies (or, after staging, only hashes) every item into one
mapped shard buffer (where each item goes: ``placement.py``) -> the shard is committed with
its manifest -> the coordinator's ``finish`` commits the global metadata. Tensor bytes are raw; only DCP's own byte items
(non-tensor values) and the global metadata are pickled, as DCP pickles them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import pickle
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from .._faults import crash_point, pause_point
from .._gc import pausing_gc
from ..errors import MLCheckpointError
from ..store.identity import Lineage, new_id
from ..store.layout import parse_step
from ..store.local_store import LocalStore, ShardWriter
from ..store.manifest import Manifest
from . import copies, groups, plans, staging
from .errors import entry_error
from .placement import Placement, copy_and_hash
from .snapshot import Snapshotter

log = logging.getLogger(__name__)


def _default_group() -> tuple[int, int]:
    """This process's rank and the world size in the default process group (0, 1 without)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class MemoryStorageWriter(StorageWriter, AsyncStager):
    """Writes one checkpoint step into the node's tmpfs store.

    Use with ``dcp.save`` (copies with checksums fused in) or ``dcp.async_save`` (``stage``
    copies straight into the tmpfs buffer, checksumming on the way, so the blocking part is
    one pass over the state dict; the commit happens in DCP's background thread or process).
    With a ``snapshots`` that guards an optimizer (``CheckpointManager.guard``), ``stage``
    returns a Future instead and copies that optimizer's tensors on the staging thread:
    ``dcp.async_save`` then returns an ``AsyncSaveResponse`` whose ``staging_completion``
    (or the guard) must be waited on before ``optimizer.step()``.

    Args:
        step: the training step this checkpoint holds (a non-negative int).
        store: the job's LocalStore; by default one for ``job_id``/``local_dir``.
        lineage: the run this save belongs to and the runs it descends from (recorded in the
            metadata, so recovery never mixes incarnations of a step); CheckpointManager passes
            its own.
        snapshots: the staging thread and guards of overlapped saves (CheckpointManager
            passes its own); None: ``stage`` always copies before it returns.
        rank, world_size: this rank in the process group the save runs on, and its size
            (CheckpointManager passes its checkpoint group's); by default the default group's.
            DCP's own rank, given when the save starts, takes precedence.
        staged: the state dict already staged for this step (``dcp/staging.py``), which
            ``write_data`` commits; else ``stage`` makes it, or ``write_data`` copies.
        keep_staged: the staged views are read after the commit (a persistent write): the
            staged region is committed as it is, bytes the plan left out included, instead of
            being trimmed to the plan (``Placement.keep_planned``).
        copy_policy: keep, on every node, one copy of each item that data parallelism holds
            there but DCP gives to a rank of another node, so that replication need not send
            it (``copies.py``; CheckpointManager passes one when it replicates); None: none.
        refuse_default_group: ``stage`` raises ConfigError when a THREAD-mode
            ``dcp.async_save`` drives this writer on the default process group, which the
            training thread uses meanwhile (``groups.py``; CheckpointManager's writers do).

    After the save, on this rank: ``committed`` (this rank's manifest, set by ``write_data``)
    and ``save_id``; on the coordinator also ``metadata`` (what ``finish`` committed). In
    DCP's PROCESS mode these are set in the checkpoint process's copy of the writer, not in
    this one: the store holds the result.
    """

    _synchronize_after_execute = False  # stage() is synchronous: nothing to wait for

    def __init__(self, step: int, store: LocalStore | None = None, *, job_id: str | None = None,
                 local_dir: str | None = None,
                 lineage: Lineage | None = None, snapshots: Snapshotter | None = None,
                 rank: int | None = None, world_size: int | None = None,
                 staged: staging.Staged | None = None, keep_staged: bool = False,
                 copy_policy: copies.CopyPolicy | None = None, refuse_default_group: bool = False):
        super().__init__()
        self.step = parse_step(step)
        self.store = store if store is not None else LocalStore(local_dir, job_id)
        self.refuse_default_group = refuse_default_group
        self.lineage = lineage or Lineage()
        self.save_id = ""  # made by the coordinator's global plan, sent to every rank in it
        default_rank, default_world = _default_group()
        self.rank = default_rank if rank is None else rank
        self.world_size = default_world if world_size is None else world_size
        self.is_coordinator = False
        self.staged = staged  # the hand-off from staging; write_data consumes it
        self.keep_staged = keep_staged
        self.copy_policy = copy_policy
        self._held: dict[copies.Key, WriteItem] = {}  # with a policy: every item this rank holds
        self._snapshots = snapshots
        self.copy_seconds = 0.0  # write_data's placing, copying and hashing
        self.stage_seconds = 0.0  # how long ``stage`` held the caller (dcp.async_save)
        self.staged_bytes = 0  # tensor bytes ``stage`` copied (or left to the staging thread)
        self.overlapped_bytes = 0  # of them, those the staging thread copies after it returned
        # Bytes of this save the host copied or hashed, staging's included (items copied from
        # device memory: none); set by write_data.
        self.host_bytes = 0
        self.committed: Manifest | None = None  # this rank's manifest once write_data committed
        self.metadata: Metadata | None = None  # the coordinator's, once finish committed it

    @property
    def checkpoint_id(self) -> str:
        return f"mlcheckpoint://{self.store.job_id}/{self.step}"

    # PROCESS mode pickles the writer into another process: keep what identifies the staged
    # buffer, drop the mapping and the staging thread.
    def __getstate__(self):
        state = self.__dict__.copy()
        state["staged"] = None if self.staged is None else self.staged.for_another_process()
        state["_snapshots"] = None
        return state

    # ---------------------------------------------------------------- AsyncStager
    @pausing_gc
    def stage(self, state_dict: dict[str, Any]
              ) -> dict[str, Any] | concurrent.futures.Future[dict[str, Any]]:
        """Copy ``state_dict`` into this step's tmpfs buffer; return views of it, or, when an
        optimizer is guarded, a Future of them that completes once every byte is in place.

        A stage that fails (e.g. CapacityError) or a failed background copy does not fail
        here: the commit raises it, so that DCP fails the step on every rank instead of
        leaving them waiting for this one; the next guard point raises a failed copy too.
        """
        if self.refuse_default_group:  # before DCP issues any collective: every rank alike
            groups.refuse_default_group(self.step)
        t0 = time.perf_counter()
        # Every tensor is staged here: DCP may run the commit in another process (PROCESS
        # mode), which could not copy a tensor left out. Those the plan should leave out go
        # last, where the commit cuts them off.
        snapshots = self._snapshots
        guarded = snapshots is not None and snapshots.guarded
        try:
            prediction = snapshots.plans.predict(state_dict) if snapshots is not None else None
            if not guarded:
                staged = self.staged = staging.stage_now(self.store, self.step, self.rank,
                                                         state_dict,
                                                         prediction or plans.NO_PREDICTION)
                self._staged_in(staged, t0)
                return staged.views
            assert snapshots is not None
            staged = self.staged = staging.stage_overlapped(
                self.store, self.step, self.rank, state_dict, snapshots, snapshots.deferrable(),
                prediction or plans.NO_PREDICTION)
            self._staged_in(staged, t0)
        except Exception as e:  # noqa: BLE001  (whatever it is, every rank hears of it)
            self.staged = staging.Staged.failed(self.step, self.rank, e)
            if not guarded:
                return self.staged.views
            done: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
            done.set_result(self.staged.views)
            return done
        views: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        assert staged.copying is not None
        staged.copying.add_done_callback(lambda _: views.set_result(staged.views))
        return views

    def _staged_in(self, staged: staging.Staged, t0: float) -> None:
        self.stage_seconds = time.perf_counter() - t0
        self.staged_bytes, self.overlapped_bytes = staged.nbytes, staged.overlapped_bytes

    def synchronize_staging(self) -> None:
        """Wait for an overlapped stage (DCP's older protocol; prefer staging_completion)."""
        if self.staged is not None:
            self.staged.result()

    def close(self) -> None:
        """Give back the buffer of a stage that is not committed."""
        if self.staged is not None:
            self.staged.release()
            if self.staged.shard is not None:
                self.staged.shard.abort()
        self.staged = None

    # ---------------------------------------------------------------- StorageWriter
    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None:
            step = parse_step(checkpoint_id)
            if step != self.step and self.staged is not None:
                raise ValueError(f"writer staged step {self.step}, asked to save {step}")
            self.step = step

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank", self.rank)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # A stage that failed fails the step here, in DCP's planning: the coordinator hands
        # this rank's error to every rank before any of them writes (a rank that went on with
        # nothing staged would leave the plan without its items: DCP's planner warns of each
        # and fails the step with its own error, not ours).
        self._raise_failed_stage()
        # With a copy policy, offer every item this rank holds (DCP's plan, not yet
        # de-duplicated) to the coordinator, which chooses the copies.
        policy = self.copy_policy
        if policy is None or self.rank >= len(policy.node_of_rank):
            return plan
        self._held = {copies.key_of(item.index): item for item in plan.items}
        offer = copies.LocalItems(node=policy.node_of_rank[self.rank], room=policy.room(),
                                  items=tuple((item.index, item.tensor_storage_size() or 0)
                                              for item in plan.items))
        return dataclasses.replace(plan, storage_data=offer)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # One id for this save, chosen once and carried to every rank in its plan: shards and
        # metadata of two saves of the same step can then never be taken for one checkpoint.
        save_id = new_id()
        offers = [plan.storage_data for plan in plans]
        policy = self.copy_policy
        if (policy is None or len(plans) < 2
                or not all(isinstance(o, copies.LocalItems) for o in offers)):
            return [dataclasses.replace(plan, storage_data=copies.PlanData(save_id))
                    for plan in plans]
        room: dict[int, int] = {}
        for o in offers:  # (the ranks of a node share its tmpfs: they offer the same room)
            room[o.node] = min(o.room, room.get(o.node, o.room))
        choice = copies.choose({rank: o.items for rank, o in enumerate(offers)},
                               {rank: [item.index for item in plan.items]
                                for rank, plan in enumerate(plans)},
                               [o.node for o in offers], room, policy.replicas,
                               sources=policy.sources, place_of_node=policy.place_of_node)
        policy.modes.note(choice)
        return [dataclasses.replace(plan, storage_data=copies.PlanData(
                    save_id, tuple(choice.copies.get(rank, ())), choice.modes))
                for rank, plan in enumerate(plans)]

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False  # never inferred from a path: users pass the writer explicitly

    @pausing_gc
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Commit this rank's shard: place every item (staged ones are in the buffer already),
        copy and hash what is not, then commit the manifest (the rename is the commit)."""
        staged, self.staged = self.staged, None  # consumed, committed or not
        try:
            return self._write_data(plan, planner, staged)
        finally:
            if staged is not None:
                staged.release()  # whatever happened, the guards must not wait any longer

    def _write_data(self, plan: SavePlan, planner: SavePlanner,
                    staged: staging.Staged | None) -> Future[list[WriteResult]]:
        if staged is not None:
            _raise_if_failed(staged)
        t0 = time.perf_counter()
        shard = self._open_staged(staged) if staged is not None else None
        try:
            pause_point("write_data", self.step, self.rank)
            resolved = [(item, _resolve(planner, item)) for item in plan.items]
            kept = [(item, _resolve(planner, item)) for item in self._kept_copies(plan)]
            if self.copy_policy is not None and isinstance(plan.storage_data, copies.PlanData):
                self.copy_policy.modes.seen(plan.storage_data.modes)  # for stats() on every rank
            if shard is None:  # sized for the raw tensors; the other items are appended
                tensors = [data for _, data in resolved + kept if isinstance(data, torch.Tensor)]
                shard = self.store.begin_shard(self.step, self.rank, staging.staged_bytes(tensors))
            crash_point("before_data", self.step, self.rank)
            placement = Placement(shard, staged.digests if staged is not None else {},
                                  restaged_bytes=_restaged_bytes(staged))
            if staged is not None and not staged.private and not self.keep_staged:
                placement.keep_planned(resolved + kept)  # only what the plan gives this rank stays
            placed = [placement.place(item, data) for item, data in resolved + kept]
            placement.finish_device()  # device tensors: copied and checksummed on the device
            placement.confirm_restaged(placed)
            half = len(placed) // 2
            hashed = copy_and_hash(placed[:half])
            crash_point("mid_data", self.step, self.rank)
            hashed += copy_and_hash(placed[half:])
            self.host_bytes = (staged.host_bytes if staged is not None else 0) + \
                placement.host_bytes + hashed
            if staged is not None:  # tensors the stage left out are copied: training may go on
                staged.release()
            results = [placement.record(p, self.rank) for p in placed]
            results[len(resolved):] = [  # told apart in ``finish``: they are no primaries
                WriteResult(wr.index, wr.size_in_bytes, copies.KeptCopy(wr.storage_data))
                for wr in results[len(resolved):]]
            self.copy_seconds = time.perf_counter() - t0
            self.save_id = _plan_save_id(plan)
            self.committed = shard.commit(world_size=self.world_size, save_id=self.save_id,
                                          run_id=self.lineage.run_id)
        except BaseException:
            if shard is not None:
                shard.abort()
            raise
        log.debug("committed step %d rank %d (%d items)", self.step, self.rank, len(results))
        if staged is not None and self._snapshots is not None:
            # the next stage follows it, copies included
            self._snapshots.plans.learn(staged.plan_key, plan, [item for item, _ in kept])
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _raise_failed_stage(self) -> None:
        """Raise the error of a stage that failed (see ``_raise_if_failed``); the writer no
        longer holds it."""
        if self.staged is not None:
            try:
                _raise_if_failed(self.staged)
            except BaseException:
                self.staged = None
                raise

    def copy_modes(self) -> tuple[str, ...]:
        """Each node's copies mode at this save, as the coordinator's plan said (() without
        copies)."""
        return self.copy_policy.modes.modes if self.copy_policy is not None else ()

    def _kept_copies(self, plan: SavePlan) -> list[WriteItem]:
        """This rank's own WriteItems of the copies the coordinator gave it to keep."""
        data = plan.storage_data
        if not isinstance(data, copies.PlanData):
            return []
        return [self._held[k] for k in map(copies.key_of, data.copies) if k in self._held]

    def _open_staged(self, staged: staging.Staged) -> ShardWriter | None:
        """The staged shard (reopened by name in DCP's checkpoint process); None for a stage
        that took no buffer (``Staged.private``): the commit begins one for the plan."""
        if staged.private:
            return None
        shard = staged.shard
        if shard is None:  # PROCESS mode: stage() ran in the trainer; reopen its buffer by name
            shard = self.store.shards.reopen(self.step, staged.rank, staged.nbytes)
        if shard.rank != self.rank:
            # stage() runs before DCP names the rank it saves as (a bare writer stages as
            # the default group's rank; DCP may use another: no_dist, a group of its own).
            shard.reassign(self.rank)
        return shard

    @pausing_gc
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        primaries, kept = {}, []
        for rank_results in results:
            for wr in rank_results:
                if isinstance(wr.storage_data, copies.KeptCopy):
                    kept.append((wr.index, wr.storage_data.location))
                else:
                    primaries[wr.index] = wr.storage_data
        # agreeing copies are attached to their primaries' locations (``ItemLocation.copies``)
        metadata.storage_data = copies.attach(primaries, kept)
        crash_point("before_metadata", self.step, self.rank)
        commit_metadata(self.store, self.step, metadata, world_size=len(results),
                        save_id=self.save_id, lineage=self.lineage, copy_modes=self.copy_modes())
        self.metadata = metadata


def _resolve(planner: SavePlanner, item: WriteItem) -> Any:
    """``planner.resolve_data``, which pickles a value that is not a tensor: a failure names the
    entry (its flattened key) and its type."""
    try:
        return planner.resolve_data(item)
    except Exception as e:
        if item.type != WriteItemType.BYTE_IO:
            raise
        try:
            value = planner.lookup_object(item.index)  # type: ignore[attr-defined]
        except (AttributeError, LookupError, ValueError):  # a planner without DCP's lookup
            raise entry_error(item.index.fqn, e) from e
        raise entry_error(item.index.fqn, e, value) from e


def _raise_if_failed(staged: staging.Staged) -> None:
    """Raise why ``staged`` failed, once its overlapped copy is over, giving its buffer back
    (the step commits nowhere) and its guards their go."""
    staged.result()  # an overlapped stage: every byte in place (or its error)
    error = staged.error()
    if error is not None:
        staged.release()
        if staged.shard is not None:
            staged.shard.abort()
        raise error


def _restaged_bytes(staged: staging.Staged | None) -> int | None:
    """The staged region's size when ``stage`` ran in another process (PROCESS mode: the
    buffer is reopened by name, and DCP hands copies of the staged views); else None."""
    return (staged.nbytes if staged is not None and staged.shard is None and not staged.private
            else None)


def _plan_save_id(plan: SavePlan) -> str:
    data = plan.storage_data
    save_id = data.save_id if isinstance(data, copies.PlanData) else None
    if not save_id:
        raise MLCheckpointError("the save plan carries no save id: MemoryStorageWriter's "
                                "prepare_global_plan did not run (use_collectives=False is "
                                "not supported)")
    return save_id


def commit_metadata(store: LocalStore, step: int, metadata: Metadata, world_size: int, *,
                    save_id: str, lineage: Lineage, copy_modes: tuple[str, ...] = ()) -> None:
    """Commit DCP's global metadata (with our ItemLocations as storage_data) into ``store``;
    ``copy_modes``: each node's copies mode at this save (recorded in its header)."""
    locations = list(metadata.storage_data.values())
    payload = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
    store.metadata.write(step, payload, world_size=world_size,
                         ranks={loc.rank for loc in locations},
                         total_bytes=sum(loc.nbytes for loc in locations),
                         save_id=save_id, lineage=lineage, copy_modes=copy_modes)
    log.debug("committed metadata of step %d (%d items)", step, len(locations))

"""A shard holds only the items DCP's final plan gives its rank (dcp/plans.py, placement.py's
``keep_planned``): in one process, a planner that hands this rank a subset of the keys plays
the part of DCP's de-duplication between ranks."""

from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from states import assert_same, clone_state, zeros_like_state
from torch import nn
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from mlcheckpoint import (
    CheckpointManager,
    MemoryStorageReader,
    MemoryStorageWriter,
)
from mlcheckpoint.dcp.plans import PlanCache
from mlcheckpoint.dcp.snapshot import Snapshotter
from mlcheckpoint.store import LocalStore
from mlcheckpoint.store.shards import align
from mlcheckpoint.testing import internals

JOB = "planned"

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class GivesThisRank(DefaultSavePlanner):
    """DCP's default planner, but the global plan gives this rank only the keys in ``keep``."""

    def __init__(self, keep: set[str]):
        super().__init__()
        self.keep = keep

    def create_global_plan(self, all_plans):
        kept = [SavePlan([i for i in p.items if i.index.fqn in self.keep or i.type ==
                          WriteItemType.BYTE_IO], p.storage_data, p.planner_data, p.usable)
                for p in all_plans]
        return super().create_global_plan(kept)


# The keys the plan gives this rank at each step: the same twice (the stage follows it),
# then another set (a tensor the stage put last is wanted, one it put first is not).
PLANS = [{"t1", "t3", "t4"}, {"t1", "t3", "t4"}, {"t0", "t1", "t3"}]


def params() -> dict[str, nn.Parameter]:
    return {f"t{i}": nn.Parameter(torch.full((1000 + 37 * i,), float(i))) for i in range(5)}


def assert_holds_only(store: LocalStore, step: int, keep: set[str], sd: dict) -> None:
    m = store.shards.read_manifest(step, 0)
    tensors = [it for it in m.items if it.kind == "tensor"]
    assert {it.key.split("@")[0] for it in tensors} == keep
    # every byte belongs to an item, but for the 64-byte alignment of each
    assert max(it.offset + it.nbytes for it in m.items) <= m.data_bytes
    assert m.data_bytes <= sum(align(it.nbytes) for it in m.items)
    assert os.stat(store.paths.data(step, 0)).st_size == m.data_bytes  # nothing past it
    out = {k: torch.zeros_like(sd[k]) for k in keep}
    dcp.load(out, storage_reader=MemoryStorageReader(step, store))
    assert all(torch.equal(out[k], sd[k].detach()) for k in keep)


@pytest.mark.parametrize("how", ["save", "stage", "guarded stage"])
def test_a_dcp_native_save_commits_only_the_planned_items(store, how):
    sd = params()
    snapshots = Snapshotter()
    optim = torch.optim.SGD(sd.values(), lr=0.1)
    if how == "guarded stage":
        snapshots.guard(optim)
    try:
        for step, keep in enumerate(PLANS):
            writer = MemoryStorageWriter(step, store, snapshots=snapshots)
            views = sd
            if how != "save":  # DCP's async_save: stage, then save the staged views
                staged = writer.stage(sd)
                views = staged.result() if hasattr(staged, "result") else staged
            dcp.save(views, storage_writer=writer, planner=GivesThisRank(keep))
            assert_holds_only(store, step, keep, sd)
            with torch.no_grad():
                for p in sd.values():
                    p.add_(1.0)
    finally:
        snapshots.close()


def model_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict:
    return {"model": model.state_dict(), "optim": optim.state_dict()}


def test_tensors_a_guarded_stage_left_out_are_copied_before_the_optimizer_step(
        store_dir, monkeypatch):
    """The prediction said another rank writes half the tensors; the plan gives them to this
    one after all. The commit copies them, and the optimizer step waits until it has."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)

    def train_step(i: int) -> None:
        optim.zero_grad()
        model(torch.randn(4, 32, generator=torch.Generator().manual_seed(i))).sum().backward()
        optim.step()

    ckpt = CheckpointManager(job_id=JOB, local_dir=store_dir, replication="none", keep=4)
    # A rank alone predicts nothing (DCP gives it every item); this test forges a prediction.
    internals(ckpt).snapshots.plans = PlanCache()
    try:
        train_step(0)
        ckpt.guard(optim)
        first = ckpt.async_save(model_state(model, optim), 0).result()
        assert first.staged_bytes > 0
        # A stale prediction: every other tensor is another rank's to write.
        key = internals(ckpt).snapshots.plans.predict(model_state(model, optim)).key
        flat = [k for k in internals(ckpt).store.shards.read_manifest(0, 0).items if k.kind == "tensor"]
        half = [WriteItem(MetadataIndex(it.key.split("@")[0]), WriteItemType.TENSOR)
                for it in flat[::2]]
        internals(ckpt).snapshots.plans.learn(key, SavePlan(half))
        train_step(1)
        expected = clone_state(model_state(model, optim))
        gate = os.path.join(store_dir, "gate")
        monkeypatch.setenv("MLCHECKPOINT_PAUSE_AT", f"write_data@1={gate}")
        fut = ckpt.async_save(model_state(model, optim), 1)
        # The commit is held before it copies what the stage left out; the optimizer step
        # must wait for it, else it changes those tensors first.
        timer = threading.Timer(0.3, lambda: open(gate, "w").close())
        timer.start()
        try:
            train_step(2)
        finally:
            timer.join()
        result = fut.result()
        tensor_bytes = sum(align(it.nbytes) for it in internals(ckpt).store.shards.read_manifest(1, 0).items
                           if it.kind == "tensor")
        assert 0 < result.staged_bytes < tensor_bytes  # half was left out, then copied
        out = zeros_like_state(expected)
        dcp.load(out, storage_reader=ckpt.storage_reader(1), no_dist=True)
        assert_same(expected, out)
        # The plan is learnt: the next stage copies every tensor (the plan gives all here).
        result = ckpt.async_save(model_state(model, optim), 2).result()
        assert result.staged_bytes == tensor_bytes
    finally:
        ckpt.close()


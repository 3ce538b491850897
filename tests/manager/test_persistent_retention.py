"""Persistent retention (issue 32): ``keep_persistent=N`` prunes the persistent folder after
each persistent write that succeeded, oldest first, and never the step a resume could need:
the newest complete one, one being written, or one without DCP's ``.metadata``. The
integrations map their frameworks' own keep settings onto it."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import torchtitan_integration
from states import assert_same, make_state, zeros_like_state
from torch.distributed.checkpoint import FileSystemWriter

from mlcheckpoint import CheckpointManager, ConfigError
from mlcheckpoint.persistent import PersistentStorage, to_prune
from mlcheckpoint.testing import internals

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def manager(store_dir: str, folder: str | PersistentStorage, **kw) -> CheckpointManager:
    return CheckpointManager(folder, job_id="job-retention", local_dir=os.path.join(store_dir, "shm"),
                             replication="none", **kw)


def persistent_steps(ckpt: CheckpointManager) -> list[int]:
    return [e.step for e in ckpt.checkpoints() if e.location == "persistent"]


def test_the_plan_keeps_the_newest_and_what_is_being_written():
    assert to_prune([3, 1, 4, 2], keep=2) == [1, 2]
    assert to_prune([1, 2, 3, 4], keep=1, spare=[2]) == [1, 3]
    assert to_prune([7], keep=1) == [] and to_prune([], keep=1) == []
    assert to_prune([1, 2], keep=5) == []


@pytest.mark.parametrize("layout", ["plain", "framework"])
def test_keep_persistent_keeps_the_newest_steps(store_dir, layout):
    folder = os.path.join(store_dir, "persistent")
    storage = PersistentStorage(folder, step_format="step-{step}") if layout == "framework" else folder
    with manager(store_dir, storage, keep_persistent=2) as ckpt:
        for step in range(3):
            ckpt.save(make_state(step), step, persistent=True)
        for step in range(3, 6):
            ckpt.async_save(make_state(step), step, persistent=True).result()
        ckpt.wait()
        assert persistent_steps(ckpt) == [4, 5]
        names = sorted(os.listdir(folder))
    assert names == (["step-4", "step-5"] if layout == "framework"
                     else ["step-000000000004", "step-000000000005"])
    with manager(store_dir, storage) as ckpt:  # the default keeps every step
        for step in range(6, 9):
            ckpt.save(make_state(step), step, persistent=True)
        assert persistent_steps(ckpt) == [4, 5, 6, 7, 8]


def test_a_failed_or_unfinished_write_never_costs_the_last_good_step(store_dir):
    folder = os.path.join(store_dir, "persistent")
    with manager(store_dir, folder, keep_persistent=1) as ckpt:
        ckpt.save(make_state(1), 1, persistent=True)
        # Step 2's write fails (its folder's name is taken by a file): nothing is pruned.
        with open(os.path.join(folder, "step-000000000002"), "w") as f:
            f.write("not a folder")
        with pytest.raises(Exception):  # noqa: B017  (DCP's error for the path, as it words it)
            ckpt.save(make_state(2), 2, persistent=True)
        assert persistent_steps(ckpt) == [1]
        # A write that stopped half way (no .metadata) counts for nothing and is left alone.
        os.makedirs(os.path.join(folder, "step-000000000003"))
        with open(os.path.join(folder, "step-000000000003", "__0_0.distcp"), "wb") as f:
            f.write(b"half")
        ckpt.save(make_state(4), 4, persistent=True)
        assert persistent_steps(ckpt) == [4]
    assert sorted(os.listdir(folder)) == ["step-000000000002", "step-000000000003",
                                          "step-000000000004"]
    loaded = zeros_like_state(make_state())
    dcp.load(loaded, checkpoint_id=os.path.join(folder, "step-000000000004"))
    assert_same(make_state(4), loaded)


def test_keep_persistent_is_checked_and_read_from_its_variable(store_dir, monkeypatch):
    folder = os.path.join(store_dir, "persistent")
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match=f"keep_persistent={bad!r}"):
            manager(store_dir, folder, keep_persistent=bad)
    monkeypatch.setenv("MLCHECKPOINT_KEEP_PERSISTENT", "3")
    with manager(store_dir, folder) as ckpt:
        assert ckpt.options.keep_persistent == 3
        writer = internals(ckpt).persistent_writer
        assert writer is not None and writer.keep == 3


def test_lightning_maps_save_top_k(store_dir):
    lightning = pytest.importorskip("mlcheckpoint.integrations.lightning")
    from lightning.pytorch.callbacks import ModelCheckpoint

    assert lightning.keep_persistent(ModelCheckpoint(dirpath=store_dir, save_top_k=1)) == 1
    assert lightning.keep_persistent(ModelCheckpoint(dirpath=store_dir, save_top_k=-1)) is None
    assert lightning.keep_persistent(ModelCheckpoint(dirpath=store_dir, monitor="loss",
                                                     save_top_k=3)) is None  # the best, not ours
    assert lightning.keep_persistent(None) is None
    # Lightning's folder layout (a sharded checkpoint per global step, with its meta.pt) prunes
    # through the same plan: the newest complete one stays, an unfinished one is left alone.
    folder = os.path.join(store_dir, "ckpts")
    for step in (10, 20, 30):
        path = os.path.join(folder, f"epoch=0-step={step}.ckpt")
        dcp.save(make_state(step), storage_writer=FileSystemWriter(path))
        if step != 30:  # step 30 is still being written: DCP is done, its meta.pt is not
            torch.save({"global_step": step}, os.path.join(path, "meta.pt"))
    storage = lightning.LightningFolder(folder, strategy=None)
    assert storage.steps() == [10, 20]
    assert storage.prune(1) == [10]
    assert sorted(os.listdir(folder)) == ["epoch=0-step=20.ckpt", "epoch=0-step=30.ckpt"]


def test_torchtitan_maps_keep_latest_k(monkeypatch):
    torchtitan = torchtitan_integration(monkeypatch)
    config = torchtitan.MemoryCheckpointManager.Config
    assert torchtitan.keep_persistent(config(keep_latest_k=3)) == 3
    assert torchtitan.keep_persistent(config(keep_latest_k=0)) is None  # torchtitan's "all"
    assert torchtitan.keep_persistent(config(keep_latest_k=3, keep_persistent=5)) == 5

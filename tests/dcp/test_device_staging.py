"""The CUDA branch of a save (dcp/device_staging.py) and the host's bytes per save.

Without a GPU, chosen CPU tensors stand in for device memory (``device_staging.on_device`` is
the one place that routes a tensor to the branch): they are copied and checksummed by the
branch's code, with the device's tensor-op engine, and the rest of the save (manifest, the
global metadata, retention, the reader, ``verify``) runs for real. What a real device adds
(streams, events, page-locked buffers) is in the GPU tests, skipped here.
"""

from __future__ import annotations

import pickle
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import damage_shard
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from mlcheckpoint import CheckpointManager, CorruptShardError
from mlcheckpoint.dcp import device_staging
from mlcheckpoint.integrity import digests
from mlcheckpoint.store.manifest import item_locations
from mlcheckpoint.testing import internals

JOB = "device-staging"


@pytest.fixture
def standins(monkeypatch):
    """Storages (data pointers) of CPU tensors that take the device branch."""
    marked: set[int] = set()
    real = device_staging.on_device
    monkeypatch.setattr(device_staging, "on_device",
                        lambda t: t.untyped_storage().data_ptr() in marked or real(t))
    return marked


def build(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(300, 700), nn.BatchNorm1d(700), nn.ReLU(), nn.Linear(700, 5))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(8, 300)).square().mean().backward()
    optim.step()
    return model, optim


def mark_device(marked: set[int], model: nn.Module, optim: torch.optim.Optimizer) -> None:
    """The parameters and AdamW state stand in for device memory (BatchNorm's buffers stay host
    tensors: a mixed state, as a GPU job's RNG and data-loader state are)."""
    for p in model.parameters():
        marked.add(p.untyped_storage().data_ptr())
        marked.update(v.untyped_storage().data_ptr() for v in optim.state[p].values()
                      if isinstance(v, torch.Tensor) and v.dim())


def tensor_bytes(sd) -> int:
    if isinstance(sd, torch.Tensor):
        return sd.numel() * sd.element_size()
    if isinstance(sd, dict):
        return sum(tensor_bytes(v) for v in sd.values())
    if isinstance(sd, (list, tuple)):
        return sum(tensor_bytes(v) for v in sd)
    return 0


def on_device_bytes(marked: set[int], sd) -> int:
    if isinstance(sd, torch.Tensor):
        return tensor_bytes(sd) if sd.untyped_storage().data_ptr() in marked else 0
    if isinstance(sd, dict):
        return sum(on_device_bytes(marked, v) for v in sd.values())
    if isinstance(sd, (list, tuple)):
        return sum(on_device_bytes(marked, v) for v in sd)
    return 0


def saved(ckpt: CheckpointManager, step: int):
    store = internals(ckpt).store
    m = store.shards.read_manifest(step, 0)
    locations = item_locations(store.metadata.read(step)[1])
    return store, m, locations


@pytest.mark.parametrize("how", ["save", "async_save", "guarded"])
def test_device_items_are_checksummed_on_the_device_and_cost_the_host_no_byte(store_dir, standins, how):
    model, optim = build()
    mark_device(standins, model, optim)
    sd = {"model": model.state_dict(), "optim": optim.state_dict(), "note": "step seven"}
    device_bytes = on_device_bytes(standins, sd)
    assert 0 < device_bytes < tensor_bytes(sd)
    with CheckpointManager(job_id=JOB, local_dir=store_dir, replication="none") as ckpt:
        if how == "guarded":
            ckpt.guard(optim)
        result = ckpt.save(sd, 7) if how == "save" else ckpt.async_save(sd, 7).result()
        if how == "guarded":  # the branch ran on the staging thread, beside AdamW's step counters
            counters = sum(v.element_size() for st in optim.state.values() for v in st.values()
                           if isinstance(v, torch.Tensor) and not v.dim())
            assert result.overlapped_bytes == device_bytes + counters
        store, m, locations = saved(ckpt, 7)
        on_device = [it for it in m.items if it.algorithm == digests.WSUM]
        assert sum(it.nbytes for it in on_device) == device_bytes
        # the host copied or hashed everything else, and none of the device items' bytes
        assert result.host_bytes == sum(it.nbytes for it in m.items) - device_bytes
        # the metadata records the same algorithm per item, and the host engine verifies them
        assert sorted((loc.offset, loc.algorithm) for loc in locations) == \
            sorted((it.offset, it.algorithm) for it in m.items)
        store.verify_shard(7, 0, [loc for loc in locations if loc.rank == 0])
        target = {"model": build(1)[0].state_dict(), "optim": build(1)[1].state_dict(), "note": ""}
        dcp.load(target, storage_reader=ckpt.storage_reader(7), no_dist=True)
        for k, v in sd["model"].items():
            assert torch.equal(target["model"][k], v), k
        assert target["note"] == "step seven"
        damage_shard(store, 7, 0, item=on_device[0].key)
        with pytest.raises(CorruptShardError, match=f"checksum mismatch in item '{on_device[0].key}'"):
            store.verify_shard(7, 0)


def test_host_bytes_of_a_cpu_save_are_every_byte_it_stores(store_dir):
    model, optim = build()
    sd = {"model": model.state_dict(), "optim": optim.state_dict()}
    with CheckpointManager(job_id=JOB, local_dir=store_dir, replication="none") as ckpt:
        for step, result in ((1, ckpt.save(sd, 1)), (2, ckpt.async_save(sd, 2).result())):
            m = internals(ckpt).store.shards.read_manifest(step, 0)
            assert all(it.algorithm is None for it in m.items)  # xxh3, recorded as before
            assert result.host_bytes == sum(it.nbytes for it in m.items) >= tensor_bytes(sd)


def test_a_device_item_is_copied_before_the_guard_lets_the_step_change_it(store_dir, standins):
    """The branch's copies and checksums read the sources before ``copied``: the guard holds
    optimizer.step() until then, so the saved bytes (and their checksums) are the pre-step
    state even though the staging thread runs after the step began."""
    model, optim = build()
    mark_device(standins, model, optim)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with CheckpointManager(job_id=JOB, local_dir=store_dir, replication="none") as ckpt:
        ckpt.guard(optim)
        gate = threading.Event()
        internals(ckpt).snapshots.submit(lambda copied: gate.wait(), label=-1)  # holds the thread
        fut = ckpt.async_save({"model": model.state_dict()}, 3)
        timer = threading.Timer(0.3, gate.set)
        timer.start()
        optim.zero_grad()
        model(torch.randn(8, 300)).square().mean().backward()
        optim.step()  # waits for the snapshot
        timer.join()
        fut.result()
        target = {"model": build(2)[0].state_dict()}
        dcp.load(target, storage_reader=ckpt.storage_reader(3), no_dist=True)
        for k, v in before.items():
            if "running" not in k and "num_batches" not in k:  # (BatchNorm's buffers: the forward's)
                assert torch.equal(target["model"][k], v), k
        internals(ckpt).store.verify_shard(3, 0)


def test_staged_checksums_travel_to_dcps_checkpoint_process_with_their_algorithm(store_dir, standins):
    """PROCESS mode pickles what staging took (``Staged.for_another_process``)."""
    model, optim = build()
    mark_device(standins, model, optim)
    with CheckpointManager(job_id=JOB, local_dir=store_dir, replication="none") as ckpt:
        writer = ckpt.storage_writer(4)
        writer.stage({"model": model.state_dict()})
        staged = pickle.loads(pickle.dumps(writer.staged.for_another_process()))
        assert {d[2] for d in staged.digests.values()} == {digests.WSUM, digests.XXH3}
        writer.staged.shard.abort()
        writer.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("how", ["save", "async_save", "guarded"])
def test_a_cuda_save_costs_the_host_no_byte_of_its_tensors(store_dir, how):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(300, 700), nn.ReLU(), nn.Linear(700, 5)).cuda()
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(8, 300, device="cuda")).square().mean().backward()
    optim.step()
    sd = {"model": model.state_dict(), "optim": optim.state_dict()}
    with CheckpointManager(job_id=JOB, local_dir=store_dir, replication="none") as ckpt:
        if how == "guarded":
            ckpt.guard(optim)
        result = ckpt.save(sd, 5) if how == "save" else ckpt.async_save(sd, 5).result()
        store, m, locations = saved(ckpt, 5)
        on_cuda = [it for it in m.items if it.algorithm == digests.WSUM]
        assert on_cuda and result.host_bytes == sum(it.nbytes for it in m.items if it not in on_cuda)
        # On the host: AdamW's step counters (0-d tensors) and DCP's pickled param_groups, no
        # more (each param_group entry is one byte item, ~1.2 KiB; their number grows with torch)
        host_items = [it for it in m.items if it not in on_cuda]
        assert all(it.kind == "bytes" or it.shape == [] for it in host_items), host_items
        store.verify_shard(5, 0, [loc for loc in locations if loc.rank == 0])  # the host engine
        target = {"model": model.state_dict(), "optim": optim.state_dict()}
        want = {k: v.clone() for k, v in target["model"].items()}
        for v in target["model"].values():
            v.zero_()
        dcp.load(target, storage_reader=ckpt.storage_reader(5), no_dist=True)  # through the ring
        for k, v in want.items():
            assert torch.equal(target["model"][k], v), k
        bad = damage_shard(store, 5, 0, item="model.0.weight")
        assert bad is not None and bad.algorithm == digests.WSUM  # verified by the device on load
        with pytest.raises(CheckpointException) as e:
            dcp.load(target, storage_reader=ckpt.storage_reader(5), no_dist=True)
        assert "checksum mismatch in item 'model.0.weight'" in str(e.value)


def test_saves_into_recycled_buffers_page_lock_none_again(store_dir, standins, standin_page_locking):
    """A blocking save places its device tensors through DCP's write path (``placement``), which
    page-locked the buffer without marking the rank as one saving from device memory: the
    pool then kept the recycled, page-locked buffers from the rank's own saves, and each save
    page-locked a buffer on the training thread (seen on an H200)."""
    made = standin_page_locking
    with CheckpointManager(job_id=JOB, local_dir=store_dir, replication="none", keep=2) as ckpt:
        state = {"w": torch.randn(1 << 18), "meta": {"lr": 0.1, "note": "x" * 5000}}
        standins.add(state["w"].untyped_storage().data_ptr())
        store, per_save = internals(ckpt).store, []
        for step in range(8):
            state["w"].add_(1)
            before = sum(n for name, n in made.items() if name != "mlckpt-prepare")
            ckpt.save(state, step)
            store.verify_shard(step, 0)  # maps the whole file, as the pg sender does
            per_save.append(sum(n for name, n in made.items() if name != "mlckpt-prepare") - before)
        assert per_save[0] == 1 and sum(per_save[4:]) == 0, (per_save, made)  # [4:]: see the GPU twin

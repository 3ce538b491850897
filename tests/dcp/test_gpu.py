"""GPU paths: staging from device memory straight into tmpfs, and replication over NCCL.

Skipped without CUDA (CI has no GPU); run on a machine with one (two for NCCL).
"""

import shutil
import tempfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from cluster import Cluster

from mlcheckpoint import CheckpointManager


def cuda(test):
    """A test that needs a CUDA device (``-m gpu`` selects it; skipped without one)."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(test))


@cuda
def test_async_save_stages_device_tensors_straight_into_tmpfs():
    root = tempfile.mkdtemp(prefix="mlckpt-gpu-", dir="/dev/shm")
    try:
        with CheckpointManager(job_id="gpu", local_dir=root, replication="none") as ckpt:
            sd = {"w": torch.randn(1 << 20, device="cuda"), "b": torch.randn(77, device="cuda").to(torch.bfloat16)}
            expected = {k: v.cpu().clone() for k, v in sd.items()}
            fut = ckpt.async_save(sd, 1)
            for v in sd.values():  # training goes on on the device: the staged copy is taken
                v.zero_()
            fut.result()
            writer = ckpt.storage_writer(2)
            staged = writer.stage(expected)
            assert all(t.device.type == "cpu" for t in staged.values())
            writer.close()
            out = {k: torch.zeros_like(v, device="cuda") for k, v in expected.items()}
            dcp.load(out, storage_reader=ckpt.storage_reader(1))
            for k, v in expected.items():
                assert torch.equal(out[k].cpu(), v)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL replication needs two GPUs")
def test_replication_over_dedicated_nccl_group():
    with Cluster(2, 1) as c:
        c.run("gpu_nccl.py", timeout=300)
        res = c.results("nccl")
        assert all(r["protected"] for r in res.values()), res
        assert all(r["held"] == [0, 1] for r in res.values()), res


def _mixed_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 256).to(torch.bfloat16)).cuda()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _cuda_step(model: torch.nn.Module, optim: torch.optim.Optimizer, i: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(i)
    optim.zero_grad()
    h = model[1](model[0](torch.randn(32, 64, device="cuda", generator=g)))
    model[2](h.to(torch.bfloat16)).float().square().mean().backward()
    optim.step()


def _host_copy(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.cpu().clone() for k, v in model.state_dict().items()}
    for i, st in enumerate(optim.state.values()):
        out.update({f"optim.{i}.{k}": v.cpu().clone() for k, v in st.items()})
    return out


@cuda
def test_cuda_adamw_round_trip_through_guard_and_dcp_thread_async_save_is_bit_exact():
    """bf16 and fp32 parameters with AdamW state on the device: an overlapped save (the guard
    waits in ``optimizer.step()``) and a DCP-native ``async_save`` in THREAD mode with our
    writer (each its own job), each resumed by a fresh manager straight into CUDA tensors,
    bit for bit."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    root = tempfile.mkdtemp(prefix="mlckpt-gpu-", dir="/dev/shm")
    try:
        model, optim = _mixed_model()
        _cuda_step(model, optim, 0)
        expected = {}
        with CheckpointManager(job_id="guarded", local_dir=root, replication="none") as ckpt:
            ckpt.guard(optim)
            expected["guarded"] = _host_copy(model, optim)
            fut = ckpt.async_save({"model": model.state_dict(), "optim": optim.state_dict()}, 1)
            _cuda_step(model, optim, 1)  # the guard waits for the snapshot in step()
            assert fut.result().overlapped_bytes > 0
        with CheckpointManager(job_id="thread", local_dir=root, replication="none") as ckpt:
            ckpt.guard(optim)  # our writer then stages in the background: an AsyncSaveResponse
            expected["thread"] = _host_copy(model, optim)
            resp = dcp.async_save({"model": model.state_dict(), "optim": optim.state_dict()},
                                  storage_writer=ckpt.storage_writer(1), no_dist=True,
                                  async_checkpointer_type=AsyncCheckpointerType.THREAD)
            resp.staging_completion.result()
            _cuda_step(model, optim, 2)
            resp.upload_completion.result()
        assert not torch.equal(model[0].weight.cpu(), expected["thread"]["model.0.weight"])
        for job, want in expected.items():
            with CheckpointManager(job_id=job, local_dir=root, replication="none") as fresh:
                new_model, new_optim = _mixed_model()
                _cuda_step(new_model, new_optim, 99)  # AdamW state to load into
                target = {"model": new_model.state_dict(), "optim": new_optim.state_dict()}
                assert fresh.resume(target).step == 1
                new_optim.load_state_dict(target["optim"])
                assert all(p.is_cuda for p in new_model.parameters())
                got = _host_copy(new_model, new_optim)
                assert got.keys() == want.keys()
                for k, v in want.items():
                    assert got[k].dtype == v.dtype, (job, k)
                    assert torch.equal(got[k].reshape(-1).view(torch.uint8),
                                       v.reshape(-1).view(torch.uint8)), (job, k)
    finally:
        shutil.rmtree(root, ignore_errors=True)

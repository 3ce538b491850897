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

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


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

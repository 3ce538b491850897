"""Jobs whose state lives on a CUDA device (tests/workers/cuda_job.py): two simulated nodes
sharing the one GPU lose a node and resume bit for bit; NCCL replication with two ranks on
one GPU is refused at once. Skipped without CUDA (CI has no GPU)."""

import pytest
import torch
from cluster import Cluster
from helpers import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

STOP, TOTAL = 3, 7  # as in the worker


def test_two_nodes_on_one_gpu_lose_a_node_and_resume_into_cuda_bit_exactly():
    with Cluster(nnodes=2, nproc=1) as c:
        c.start("cuda_job.py", "train")

        def ready_or_failed() -> dict:
            if len(c.running()) < 2:
                pytest.fail(f"a node exited before it was ready\n{c.logs()}")
            return len(c.results("ready")) == 2 and c.results("ready")

        ready = wait_for(ready_or_failed, "every rank saved and replicated step STOP",
                         timeout=240, diag=c.logs)
        c.nodes[1].kill()
        c.nodes[1].wipe()
        c.nodes[0].kill()
        c.run("cuda_job.py", "resume", timeout=240)
        ref, res = c.results("reference"), c.results("resumed")
    for rank in (0, 1):
        assert ready[rank]["replicated"] and ready[rank]["devices"] == ["cuda"], ready
        assert all(o > 0 for o in ready[rank]["overlapped"]), ready  # copied while training went on
        r = res[rank]
        assert r["step"] == STOP and r["sources"] == {"0": "local", "1": "peer"}, r
        assert r["on_device"], r
        assert r["losses"] == ref[rank]["losses"][STOP + 1:], (r, ref[rank])
        assert r["digest"] == ref[rank]["digest"]


def test_nccl_replication_with_two_ranks_on_one_gpu_is_refused_at_construction():
    with Cluster(nnodes=2, nproc=1) as c:  # both simulated nodes on cuda:0
        c.run("cuda_job.py", "nccl_one_gpu", timeout=120)
        res = c.results("nccl")
    assert sorted(res) == [0, 1], res
    for r in res.values():
        assert r["error"] is not None and "a CUDA device per rank" in r["error"], r
        assert "ranks [0, 1] use one GPU" in r["error"], r

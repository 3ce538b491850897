"""Jobs whose state lives on a CUDA device (tests/workers/cuda_job.py): two simulated nodes
sharing the one GPU lose a node and resume bit for bit; NCCL replication with two ranks on
one GPU is refused at once; with replication on, a save page-locks no buffer again once the
buffers are made; a rank on cuda:1 makes no CUDA context on device 0 from any thread of the
library. Skipped without CUDA (CI has no GPU)."""

import pytest
import torch
from cluster import Cluster
from helpers import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

STOP, TOTAL = 3, 7  # as in the worker


def test_two_nodes_on_one_gpu_lose_a_node_and_resume_into_cuda_bit_exactly():
    """CUDA tensors saved with the copy overlapped with training, node 1 lost: the resume
    loads onto the GPU from the partner and training goes on bit-exactly."""
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
    """NCCL replication with two ranks on one GPU is refused when the manager is built, on
    every rank, with words naming the ranks and the fix."""
    with Cluster(nnodes=2, nproc=1) as c:  # both simulated nodes on cuda:0
        c.run("cuda_job.py", "nccl_one_gpu", timeout=120)
        res = c.results("nccl")
    assert sorted(res) == [0, 1], res
    for r in res.values():
        assert r["error"] is not None and "a CUDA device per rank" in r["error"], r
        assert "ranks [0, 1] use one GPU" in r["error"], r


def test_saves_with_replication_page_lock_no_buffer_again_once_they_are_made():
    """The pg sender maps each committed shard whole (its byte items lie past the staged
    region): that mapping goes beside the writer's page-locked one, so the recycled buffer a
    later save takes is still registered. Registering it again (a second or more of pinning
    per GiB) on the training thread at every save was what replacing it cost."""
    with Cluster(nnodes=2, nproc=1) as c:
        c.run("cuda_job.py", "registrations", timeout=240)
        res = c.results("registrations")
    assert sorted(res) == [0, 1], res
    for r in res.values():
        # The first save registers its fresh buffer; the warmer makes the next ones
        # registered; from the buffers' first recycling on, no save registers any.
        assert sum(r["per_save"][4:]) == 0, r
        assert r["per_save"][0] <= 1, r


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a rank on cuda:1 needs two GPUs")
def test_a_rank_on_cuda_1_makes_no_context_on_device_0():
    """Every thread of the library that calls CUDA (the staging thread, the buffer warmer
    page-locking buffers, retention releasing them, the resume's ring) runs with the rank's
    device current: none makes a context on device 0 (hundreds of MiB per rank on a node)."""
    with Cluster(nnodes=1, nproc=1) as c:
        c.run("cuda_job.py", "contexts", timeout=180)
        res = c.results("contexts")
    assert res[0] == {"device0": False, "device1": True}, res

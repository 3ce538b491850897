"""Overlapped saves in real torchrun jobs: DCP's own async protocol (THREAD and PROCESS), a
background copy failing on one rank, and a 2-node job that loses a node and resumes bit for
bit (see tests/workers/overlapped_job.py)."""

import pytest
from cluster import Cluster
from helpers import from_another_node, wait_for

pytestmark = pytest.mark.slow

STOP, TOTAL = 3, 6  # as in the worker


def test_dcp_native_overlap_and_a_staging_failure_on_one_rank():
    """DCP-native async_save (thread and process mode) copies while the step runs and saves
    the snapshot; a staging failure on one rank reaches every rank's future."""
    with Cluster(nnodes=1, nproc=2) as c:
        c.run("overlapped_job.py", "native", timeout=120)
        res = c.results("native")
    for rank, r in res.items():
        for mode in ("thread", "process"):
            assert r[f"{mode}_response"], (rank, mode)  # stage() returned a Future
            assert r[f"{mode}_overlapped"] > 0, (rank, mode)
            assert r[f"{mode}_changed"], (rank, mode)  # the step changed what was saved ...
            assert r[f"{mode}_differs"] == [], (rank, mode, r)  # ... after the snapshot
        assert r["future"] == "StagingError" and r["step4_complete"] is False, (rank, r)
        assert r["step3_differs"] == [] and r["after"] == 6, (rank, r)
        assert r["next_save"] == "ok", (rank, r)  # the failed save's future said it: no more
    # every rank's future says the same, naming the rank that failed; that rank also hears of
    # it at its guard
    assert res[0]["future_text"] == res[1]["future_text"], res
    assert "async save of step 4 failed on rank 1 (node 0): " in res[0]["future_text"], res
    assert (res[0]["guard"], res[1]["guard"]) == ("ok", "StagingError"), res


def test_two_node_job_with_overlapped_saves_loses_a_node_and_resumes_bit_exactly():
    """Overlapped saves (the guarded optimizer) copy while training goes on; after node 1 is
    lost the job resumes from the partner with the reference run's losses."""
    with Cluster(nnodes=2, nproc=1) as c:
        c.start("overlapped_job.py", "train")
        ready = wait_for(lambda: len(c.results("ready")) == 2 and c.results("ready"),
                         "every rank saved and replicated step STOP", diag=c.logs)
        c.nodes[1].kill()
        c.nodes[1].wipe()
        c.nodes[0].kill()
        c.run("overlapped_job.py", "resume", timeout=240)
        ref, res = c.results("reference"), c.results("resumed")
    for rank in (0, 1):
        assert ready[rank]["replicated"], ready
        # the guarded optimizer owns every tensor: all of them were copied while training went
        # on (every one at the first save; later only those DCP's plan gave this rank, which
        # leaves the replicated AdamW step counters to one rank)
        overlapped, tensor_bytes = ready[rank]["overlapped"], ready[rank]["tensor_bytes"]
        assert overlapped[0] == tensor_bytes[0], ready
        assert all(0 < o <= t for o, t in zip(overlapped, tensor_bytes, strict=True)), ready
        r = res[rank]
        assert r["step"] == STOP and from_another_node(r["sources"], [1]) and len(r["sources"]) == 2, r
        assert r["losses"] == ref[rank]["losses"][STOP + 1:], (r, ref[rank])
        assert r["digest"] == ref[rank]["digest"]

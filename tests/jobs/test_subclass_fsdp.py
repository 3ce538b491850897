"""Tensor subclasses under FSDP2 on several ranks (tests/workers/subclass_fsdp.py): DTensors
whose local tensor is torchao's float8 FSDP weight or our own wrapper subclass, saved on 2
ranks (2 nodes) through every path (save, async_save with and without guard, DCP-native save
and async_save in THREAD and PROCESS mode) and through FileSystemWriter, then resumed on 1
rank and, with node 1 replaced by an empty one, on 4 ranks: ranks of node 1 read from the
peer. Wherever DCP's FileSystemReader loads the source exactly, ours must too. PROCESS mode
also runs on the ranks' local (subclass) tensors themselves.
"""

from __future__ import annotations

import pytest
from cluster import Cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

LAUNCH_TIMEOUT = 300
OURS = ["save", "async_save", "guard_async_save", "dcp_save", "dcp_async_thread",
        "dcp_async_process"]


def launch(c: Cluster, phase: str, nnodes: int, nproc: int) -> dict[int, dict]:
    c.clear_results()
    c.nproc = nproc
    nodes = list(range(nnodes))
    c.start("subclass_fsdp.py", phase, nodes=nodes, nnodes=nnodes)
    codes = c.wait(LAUNCH_TIMEOUT, nodes=nodes)
    assert codes == [0] * nnodes, f"exit codes {codes}; logs:\n{c.logs()}"
    return c.results("saved" if phase == "save" else f"resumed-w{nnodes * nproc}")


@pytest.fixture(scope="module")
def runs():
    with Cluster(2, 1) as c:
        saved = launch(c, "save", 2, 1)
        on_one = launch(c, "resume", 1, 1)
        c.nodes[1].wipe()  # a replacement machine: its ranks read what node 0 holds
        on_four = launch(c, "resume", 2, 2)
        yield {"saved": saved, 1: on_one, 4: on_four}


@pytest.mark.parametrize("world", [1, 4])
def test_subclass_dtensors_resume_resharded_as_dcp_loads_them(runs, world):
    """Subclass DTensors saved on 2 ranks by every path load on 1 and on 4 ranks (node 1
    replaced) exactly where DCP's FileSystemReader does."""
    saved = runs["saved"]
    assert sorted(saved) == [0, 1]
    for rank, r in saved.items():
        assert all(v is None for v in r["results"].values()), (rank, r["results"])
    resumed = runs[world]
    assert sorted(resumed) == list(range(world))
    for rank, r in resumed.items():
        fs = r["results"]["fs"]
        assert isinstance(fs, dict) and fs["diff"] == [], (rank, fs)  # DCP is exact here
        assert "ScaledTensor" in fs["types"], fs  # what this test is about: subclass locals
        for path in OURS:
            got = r["results"][path]
            assert isinstance(got, dict) and got["diff"] == [] and got["step"] == 1, (rank, path, got)


def test_process_mode_saves_subclass_shards_as_dcp_does(runs):
    """Ours loads exactly what was saved (the state at the call). (DCP's own PROCESS mode
    stager is not exact for our wrapper subclass, which it copies with its own ``copy_``
    semantics; where it is exact, so is ours.)"""
    for rank, r in runs["saved"].items():
        assert r["process"]["ours"] == [], (rank, r["process"])


def test_four_ranks_read_from_the_peer(runs):
    """Node 1 was replaced: its ranks (2, 3) resumed every path from node 0's memory."""
    for rank in (2, 3):
        for path in OURS:
            assert runs[4][rank]["results"][path]["source"] == "peer", (rank, path, runs[4][rank])


def test_torchao_float8_weights_were_among_them(runs):
    """Without torchao the float8 layers are left out: say so (a skip), not a pass."""
    if not runs["saved"][0]["torchao"]:
        pytest.skip("torchao is not installed: the float8 FSDP layers were left out")
    for world in (1, 4):
        for rank, r in runs[world].items():
            for path in ["fs", *OURS]:
                assert "WeightWithDynamicFloat8CastTensor" in r["results"][path]["types"], (world, rank, path)

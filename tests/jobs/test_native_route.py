"""The DCP-native route (``dcp.save``/``dcp.async_save`` with ``ckpt.storage_writer(step)``)
in real torchrun jobs: the loop docs/integration.md writes, with a persistent
``FileSystemWriter`` async save in flight beside the in-memory one, losing a node and
resuming bit for bit; every route publishing a save alike; and the one setup that cannot work
refused (see tests/workers/native_route.py)."""

import os

import pytest
from cluster import Cluster
from helpers import from_another_node, wait_for

from mlcheckpoint import history
from mlcheckpoint.store import LocalStore

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STOP, TOTAL, PERSIST_EVERY = 21, 25, 5  # as in the worker
SAVES = 4
NPROC = 2


def node_view(c: Cluster, node: int, job_id: str) -> dict:
    """What one node's tmpfs and history say about a job: the steps whose metadata is here
    (step -> save id), the steps this node's own shards of are here ("shards") and of them
    those whose metadata names that save ("owned"), the steps complete here (every rank's
    shard too), and (step, rank) of every save recorded."""
    store = LocalStore(c.nodes[node].local_dir, job_id, create=False)
    ranks = set(range(node * c.nproc, (node + 1) * c.nproc))
    try:
        inv = store.inventory.all()
        saves = {(e["step"], e["rank"]) for e in history.read(store.job_dir) if e["event"] == "save"}
        return {"metadata": {s: st.save_id for s, st in inv.items() if st.has_metadata},
                "shards": sorted(s for s, st in inv.items() if ranks <= st.committed_ranks),
                "owned": sorted(s for s, st in inv.items() if ranks <= st.ranks_of(st.save_id)),
                "complete": sorted(s for s, st in inv.items() if st.complete),
                "saves": saves}
    finally:
        store.close()


def test_native_async_saves_beside_a_persistent_async_save_lose_a_node_and_resume_exactly():
    """RAM every step, disk every PERSIST_EVERY steps, both with dcp.async_save and both in
    flight at once, on 2 nodes x 2 ranks of FSDP2 with TCP replication; then node 1 is lost
    with its memory and the job resumes from the partner's replicas bit for bit."""
    with Cluster(nnodes=2, nproc=NPROC) as c:
        c.start("native_route.py", "train")
        ready = wait_for(lambda: len(c.results("ready")) == 2 * NPROC and c.results("ready"),
                         "every rank saved and replicated step STOP", timeout=600, diag=c.logs)
        views = [node_view(c, n, c.job_id) for n in (0, 1)]
        persisted = sorted(d for d in os.listdir(c.persistent_dir)
                           if os.path.exists(os.path.join(c.persistent_dir, d, ".metadata")))
        c.nodes[1].kill()
        c.nodes[1].wipe()
        c.nodes[0].kill()
        c.run("native_route.py", "resume", timeout=300)
        ref, res = c.results("reference"), c.results("resumed")
    for rank, r in ready.items():
        assert r["replicated"] and r["stats_step"] == STOP and r["warmed"], (rank, r)
    # every step was published on every rank, and its metadata reached both nodes
    for node, view in enumerate(views):
        ranks = range(node * NPROC, (node + 1) * NPROC)
        assert view["saves"] == {(s, r) for s in range(STOP + 1) for r in ranks}, (node, view)
        assert view["owned"] == view["shards"], (node, view)
        assert {STOP - 1, STOP} <= set(view["owned"]) and STOP in view["complete"], (node, view)
    assert views[0]["metadata"][STOP] == views[1]["metadata"][STOP]
    assert persisted == [f"step-{s:012d}" for s in range(0, STOP + 1, PERSIST_EVERY)]
    for rank in range(2 * NPROC):
        r = res[rank]
        assert r["step"] == STOP and r["next"] == STOP + 1, r
        assert from_another_node(r["sources"], range(NPROC, 2 * NPROC)) and len(r["sources"]) == 2 * NPROC, r
        assert r["losses"] == ref[rank]["losses"][STOP + 1:], (r, ref[rank])
        assert r["digest"] == ref[rank]["digest"]


ROUTES = ["manager", "dcp", "dcp_async", "dcp_async_process"]


def test_every_route_publishes_a_save_alike():
    """Whichever route saved, the same happens after each commit: a history record per rank
    and step, the metadata of the kept steps on every node, the replicator told (the last step
    protected), buffers prepared, ``stats()`` naming the last save."""
    with Cluster(nnodes=2, nproc=1) as c:
        jobs = {route: c.sub_job(route) for route in ROUTES}
        c.run("native_route.py", "routes", *(f"{jobs[r]}:{r}" for r in ROUTES), timeout=400)
        reports = {r: c.results(f"route-{jobs[r]}") for r in ROUTES}
        views = {r: [node_view(c, n, jobs[r]) for n in (0, 1)] for r in ROUTES}
    for route in ROUTES:
        for rank, rep in reports[route].items():
            assert rep == {"replicated": True, "stats_step": SAVES - 1, "warmed": True}, (route, rank, rep)
        for node, view in enumerate(views[route]):
            assert view["saves"] == {(s, node) for s in range(SAVES)}, (route, node, view)
            # the steps kept (keep=2: the two newest) come with their metadata on both nodes,
            # the last one protected, so whole on both. An older one may lack it: node 0's
            # retention can retire a step before rank 0 shared its metadata (a DCP-native
            # save's is shared after the commit), and the other node's shard of it then waits
            # for that node's next retention pass.
            assert view["owned"][-2:] == view["shards"][-2:] == [SAVES - 2, SAVES - 1], \
                (route, node, view)
            assert SAVES - 1 in view["complete"], (route, node, view)
        newest = [{s: v["metadata"][s] for s in (SAVES - 2, SAVES - 1)} for v in views[route]]
        assert newest[0] == newest[1], (route, views[route])


def test_async_save_on_the_default_group_is_refused_on_every_rank():
    """dcp.async_save with the manager's writer on the default group would share it with the
    training thread's collectives: every rank gets the same ConfigError, at the call, and the
    documented call with ``process_group=ckpt.process_group`` then saves."""
    with Cluster(nnodes=1, nproc=2) as c:
        c.run("native_route.py", "refused", timeout=180)
        res = c.results("refused")
    assert sorted(res) == [0, 1]
    for rank, r in res.items():
        assert r["error"] is not None and "process_group=ckpt.process_group" in r["error"], (rank, r)
        assert "default process group" in r["error"], r
        assert r["complete"] == [1], r

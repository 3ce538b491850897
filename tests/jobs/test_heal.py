"""A replaced node is protected again: real torchrun jobs over simulated nodes.

Each test saves steps 1-3 (step 1 also to the persistent folder) and waits until step 3 is
protected; then loses nodes (SIGKILL, memory wiped) and restarts with empty replacements. The
resume loads step 3 exactly, and the loaded step must regain its places in the background:
``wait_replicated(3)`` True on every rank, each replaced node holding again what the save had
left there (its own shards whole, its partners' replicas, nothing more), and nothing sent
again to the nodes that kept theirs. A second loss right after (the nodes that held the only
copies while the replacements were empty) must resume step 3 again, not the persistent step 1.
The states hold items DCP writes once (from rank 0), of which data parallelism keeps copies,
beside each rank's own tensors: the replaced ranks' shards are whole on no survivor, so their
items are read through partial replicas and copies ("copies"), the layout the heal used to
skip.
"""

from __future__ import annotations

import pytest
from cluster import Cluster

from mlcheckpoint import history
from mlcheckpoint.store import LocalStore

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

LAST = 3
LAUNCH_TIMEOUT = 180
HEAL_TIMEOUT = 60  # wait_replicated's bound in the worker (a heal of these states takes ~1 s)


def store(c: Cluster, node: int) -> LocalStore:
    return LocalStore(c.nodes[node].local_dir, c.job_id, create=False)


def holdings(c: Cluster, node: int) -> dict:
    """What ``node`` holds of step ``LAST``: whether its metadata, and per owner rank whether
    a partial replica, its data bytes, its save and its items (offset, bytes, checksum)."""
    s = store(c, node)
    try:
        st = s.inventory.step_state(LAST)
        out: dict = {"metadata": st.has_metadata}
        for owner in sorted(st.committed_ranks):
            m = s.shards.read_manifest(LAST, owner)
            out[owner] = (m.partial, m.data_bytes, m.save_id,
                          sorted((it.offset, it.nbytes, it.checksum) for it in m.items))
        return out
    finally:
        s.close()


def events(c: Cluster, node: int) -> list[dict]:
    s = store(c, node)
    try:
        return history.read(s.job_dir)
    finally:
        s.close()


def save(c: Cluster, layout: str, env: dict[str, str] | None = None) -> None:
    c.run("heal_job.py", layout, "save", str(LAST), timeout=LAUNCH_TIMEOUT, env=env)
    saved = c.results("saved")
    assert sorted(saved) == list(range(c.nnodes * c.nproc)), c.logs()
    assert all(rep["protected"] for rep in saved.values()), (saved, c.logs())


def resume(c: Cluster, layout: str, heal: bool,
           env: dict[str, str] | None = None) -> tuple[dict[int, dict], dict[int, dict]]:
    """Restart the job; per rank, what it resumed (step ``LAST``, exactly) and (``heal``)
    whether the step was then protected again."""
    c.clear_results()
    c.run("heal_job.py", layout, "resume", str(LAST), str(HEAL_TIMEOUT if heal else 0),
          timeout=LAUNCH_TIMEOUT + HEAL_TIMEOUT, env=env)
    resumed = c.results("resumed")
    assert sorted(resumed) == list(range(c.nnodes * c.nproc)), c.logs()
    for r, rep in resumed.items():
        assert rep["step"] == LAST and rep["mismatch"] == [], (r, rep, c.logs())
    return resumed, c.results("healed")


def lose_and_heal(c: Cluster, layout: str, lost: list[int],
                  env: dict[str, str] | None = None) -> dict[int, dict]:
    """Lose ``lost``, restart, and check the heal; returns what each rank resumed."""
    before = {n: holdings(c, n) for n in range(c.nnodes)}
    logged = {n: len(events(c, n)) for n in range(c.nnodes)}
    for n in lost:
        c.nodes[n].kill()
        c.nodes[n].wipe()
    resumed, healed = resume(c, layout, heal=True, env=env)
    assert sorted(healed) == list(range(c.nnodes * c.nproc)), c.logs()
    for r, rep in healed.items():
        assert rep["protected"] is True and rep["newest_protected"] == LAST, (r, rep, c.logs())
    for n in range(c.nnodes):  # as the save left every node: no more, no less
        assert holdings(c, n) == before[n], (n, before[n], holdings(c, n))
    for n in range(c.nnodes):  # only what the replaced nodes lacked was sent
        for e in events(c, n)[0 if n in lost else logged[n]:]:
            if e["event"] == "replicate":
                to_replaced = any(t // c.nproc in lost for t in e["targets"])
                assert (e["bytes"] > 0) == to_replaced, (n, e)
    return resumed


@pytest.mark.parametrize("nnodes,first,second", [(3, [1], [2]), (4, [1, 2], [0, 3])],
                         ids=["ring-of-3", "4-nodes"])
def test_replaced_nodes_are_protected_again(nnodes, first, second):
    """Ring of 3 (node 1 lost, then node 2: the one that held node 1's only replica) and 4
    nodes in pairs (nodes 1 and 2 lost, then 0 and 3: their partners), 1 rank each: after the
    first restart every rank's ``wait_replicated(3)`` is True, and after the second loss the
    job resumes step 3 from memory again, exactly."""
    with Cluster(nnodes, 1) as c:
        save(c, "rank")
        resumed = lose_and_heal(c, "rank", first)
        assert all(resumed[0]["sources"][str(r)] == "copies" for r in first), resumed[0]
        for n in second:
            c.nodes[n].wipe()
        resume(c, "rank", heal=False)


@pytest.mark.parametrize("transport", ["tcp", "pg"])
def test_ddp_node_replaced_then_the_other_lost(transport):
    """DDP over 2 nodes x 2 ranks (an identical model, each rank's RNG state and loader
    position): node 1 is lost, its ranks resume from the copies on node 0 and the partial
    replicas of their own entries; once healed (``wait_replicated`` True), node 0 is lost and
    the job resumes step 3 from node 1 alone. Over TCP and over the job's process group
    (gloo): the heal's pushes of partial replicas travel over either."""
    env = {"TEST_REPLICATION": transport}
    with Cluster(2, 2) as c:
        save(c, "ddp_rng", env)
        resumed = lose_and_heal(c, "ddp_rng", [1], env)
        assert resumed[0]["sources"]["2"] == resumed[0]["sources"]["3"] == "copies", resumed[0]
        c.nodes[0].wipe()
        resume(c, "ddp_rng", heal=False, env=env)

"""Recovery with real processes: simulated nodes (one torchrun agent and tmpfs dir each),
wiped nodes, SIGKILLs mid-save and mid-recovery, corrupt copies, persistent fallbacks and
world-size changes. Every resumed state is compared bit for bit with what was saved.

To keep the number of launches small, one cluster of four simulated nodes hosts every
scenario as its own job (own job id, so own directory on every node): the jobs run one after
the other inside each launch, and the test damages each job's directories differently
between launches. Launches (each a fresh set of processes):

  A  2 nodes x 1 rank : every 2-node job saves; the last one dies mid-save (SIGKILL)
  B  4 nodes x 1 rank : the job saved by 2 ranks resumes on 4; the 4-rank jobs save
  -- damage: wipe nodes, flip bytes, delete steps, move shards between nodes --
  C  2 nodes x 1 rank : every job resumes; the last one dies mid-fetch (SIGKILL)
  D  2 nodes x 1 rank : the job killed during its recovery resumes again

A second cluster (2 nodes x 2 ranks) covers several ranks per node: a save loop whose node 1
is SIGKILLed whole, a corrupt metadata copy, a corrupt replica, and a rank killed mid-load.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time

import pytest
from cluster import Cluster, died_of_sigkill, kill_strays, lose_node
from helpers import damage_shard, flip_byte

from mlcheckpoint.store import LocalStore, layout

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.usefixtures("whole_replicas")]

LAUNCH_TIMEOUT = 150

# name -> spec (see tests/workers/rec_jobs.py). Steps 2..3 (or 2..4) are saved; keep=2.
SAVE = {
    "intact": {"first": 2, "last": 3},
    "wipe1": {"first": 2, "last": 3},
    "corrupt2": {"first": 2, "last": 3},
    "persist_wiped": {"first": 2, "last": 3, "persist": 3},
    "persist_newer": {"first": 2, "last": 4, "persist": 4},
    "orphans": {"first": 2, "last": 3},
    "empty": {"first": 2, "last": 3},
    "recovkill": {"first": 2, "last": 3},
    "w2": {"first": 1, "last": 2, "state": "elastic"},  # saved by 2 ranks, resumed by 4
    # last: rank 0 (the coordinator) is SIGKILLed before step 4's metadata is written
    "midsave": {"first": 2, "last": 4, "crash": "before_metadata@4#0"},
}
SAVE_4 = {  # saved by 4 ranks, resumed by 2
    "w4_moved": {"first": 2, "last": 3, "state": "elastic"},
    "w4_persist": {"first": 2, "last": 3, "state": "elastic", "persist": 3},
    "w4_fresh": {"first": 2, "last": 3, "state": "elastic"},
}
RESUME = {
    "intact": {"heal": True}, "wipe1": {"heal": True},
    "corrupt2": {},
    "persist_wiped": {"persist": 3}, "persist_newer": {"persist": 4}, "orphans": {},
    "empty": {}, "midsave": {},
    "w4_moved": {"state": "elastic"}, "w4_persist": {"state": "elastic", "persist": 3},
    "w4_fresh": {"state": "elastic"},
    # last: rank 1 is SIGKILLed while receiving its shard from node 0 into its tmpfs (the
    # replacement node's copy being rebuilt); it waits for that copy after the resume
    "recovkill": {"crash": "rebuild_before_commit@3#1", "await_own": True},
}


# ---------------------------------------------------------------------------- helpers
def specs(c: Cluster, table: dict[str, dict]) -> str:
    return json.dumps([dict(spec, job=f"{c.job_id}-{name}") for name, spec in table.items()])


def launch(c: Cluster, nnodes: int, table: dict[str, dict], *, dies: int | None = None) -> str:
    """Run one launch of rec_jobs.py on nodes 0..nnodes-1; return the launch's log text.
    ``dies``: the node whose rank is expected to SIGKILL itself (the others are then killed)."""
    c.clear_results()
    nodes = list(range(nnodes))
    starts = [len(c.nodes[k].log()) for k in nodes]
    c.start("rec_jobs.py", specs(c, table), nodes=nodes, nnodes=nnodes)
    if dies is None:
        codes = c.wait(LAUNCH_TIMEOUT, nodes=nodes)
        assert codes == [0] * nnodes, f"exit codes {codes}; logs:\n{c.logs()}"
    else:
        c.wait(LAUNCH_TIMEOUT, nodes=[dies])
        c.kill_all()  # the survivors would wait for the dead rank in a collective
        kill_strays(c)
    return "\n".join(f"--- node {k} ---\n{c.nodes[k].log()[s:]}" for k, s in zip(nodes, starts))


def results(c: Cluster, kind: str, name: str) -> dict[int, dict]:
    return c.sub_job_results(kind, name)


def job_dir(c: Cluster, node: int, name: str) -> str:
    return c.sub_job_dir(node, name)


def open_store(c: Cluster, node: int, name: str) -> LocalStore:
    return c.sub_job_store(node, name)


def holdings(c: Cluster, node: int, name: str) -> dict[int, tuple[bool, list[int]]]:
    """step -> (has metadata, committed ranks) in one node's directory of a job."""
    if not os.path.isdir(job_dir(c, node, name)):
        return {}
    store = open_store(c, node, name)
    try:
        return {s: (st.has_metadata, sorted(st.committed_ranks)) for s, st in store.inventory.all().items()}
    finally:
        store.close()


def wipe_job(c: Cluster, node: int, name: str) -> None:
    shutil.rmtree(job_dir(c, node, name))


def move_shard(c: Cluster, name: str, step: int, owner: int, src: int, dst: int) -> None:
    """Move a committed shard (data and manifest) from one node's directory to another's."""
    s, d = open_store(c, src, name), open_store(c, dst, name)
    try:
        os.makedirs(d.paths.step_dir(step), exist_ok=True)
        shutil.copy2(s.paths.data(step, owner), d.paths.data(step, owner))
        shutil.copy2(s.paths.manifest(step, owner), d.paths.manifest(step, owner))
        os.unlink(s.paths.manifest(step, owner))
        os.unlink(s.paths.data(step, owner))
    finally:
        s.close()
        d.close()


def sources(r: dict) -> dict[int, str]:
    return {int(k): v for k, v in r["sources"].items()}


def check_exact(res: dict[int, dict], ranks: int, step, log: str = "") -> None:
    assert sorted(res) == list(range(ranks)), f"ranks reporting: {sorted(res)}\n{log[-8000:]}"
    for rank, r in res.items():
        assert r["step"] == step, (rank, r, log[-8000:])
        assert r["match"] and not r["mismatch"], (rank, r)
        assert r["world"] == ranks


# ---------------------------------------------------------------------------- the run
@pytest.fixture(scope="module")
def run():
    with Cluster(4) as c:
        o: dict = {"c": c}

        # A: 2 nodes save; midsave's coordinator dies before writing step 4's metadata.
        o["log_a"] = launch(c, 2, SAVE, dies=0)
        o["midsave_a"] = {n: holdings(c, n, "midsave") for n in (0, 1)}
        o["intact_a"] = {n: holdings(c, n, "intact") for n in (0, 1)}
        o["persist_newer_a"] = {n: holdings(c, n, "persist_newer") for n in (0, 1)}

        # B: the 2-rank job resumes on 4 nodes; the 4-rank jobs save.
        o["log_b"] = launch(c, 4, {"w2": {"state": "elastic"}, **SAVE_4})
        o["w2"] = results(c, "resume", "w2")
        o["w4_b"] = {n: holdings(c, n, "w4_moved") for n in range(4)}

        # Damage between the launches.
        wipe_job(c, 1, "wipe1")
        for n in (0, 1):
            with contextlib.closing(open_store(c, n, "corrupt2")) as store:
                damage_shard(store, 3, 0)
        for n in (0, 1):
            wipe_job(c, n, "persist_wiped")
            wipe_job(c, n, "empty")
            shutil.rmtree(open_store(c, n, "persist_newer").paths.step_dir(4))
        wipe_job(c, 1, "orphans")
        orphan_store = open_store(c, 0, "orphans")
        for s in orphan_store.inventory.steps():  # shards without metadata: unusable leftovers
            os.unlink(orphan_store.paths.metadata(s))
        o["orphans_before"] = holdings(c, 0, "orphans")
        wipe_job(c, 1, "recovkill")
        # w4_moved: node 1 gets what node 2 held (shards 2 and 3), then at step 3 shards 1
        # and 2 swap nodes: every shard survives, but each new rank must read across nodes.
        wipe_job(c, 1, "w4_moved")
        shutil.copytree(job_dir(c, 2, "w4_moved"), job_dir(c, 1, "w4_moved"))
        move_shard(c, "w4_moved", 3, 1, src=0, dst=1)
        move_shard(c, "w4_moved", 3, 2, src=1, dst=0)
        o["w4_moved_before"] = {n: holdings(c, n, "w4_moved") for n in (0, 1)}
        o["w4_persist_before"] = {n: holdings(c, n, "w4_persist") for n in (0, 1)}

        # C: everything resumes on 2 nodes; recovkill's rank 1 dies while fetching.
        o["log_c"] = launch(c, 2, RESUME, dies=1)
        for name in RESUME:
            o[name] = results(c, "resume", name)
            o[f"{name}_healed"] = results(c, "healed", name)
            o[f"{name}_after"] = {n: holdings(c, n, name) for n in (0, 1)}

        # D: the job whose recovery was killed resumes again.
        o["log_d"] = launch(c, 2, {"recovkill": {"heal": True}})
        o["recovkill_d"] = results(c, "resume", "recovkill")
        o["recovkill_d_healed"] = results(c, "healed", "recovkill")
        o["recovkill_d_after"] = {n: holdings(c, n, "recovkill") for n in (0, 1)}
        yield o


# ---------------------------------------------------------------------------- 2 nodes x 1 rank
def test_restart_with_everything_intact_is_local(run):
    """Both nodes intact: the restart loads step 3 from local memory, fetching nothing, and
    the step is protected again."""
    assert run["intact_a"][0] == run["intact_a"][1] == {2: (True, [0, 1]), 3: (True, [0, 1])}
    res = run["intact"]
    check_exact(res, 2, 3, run["log_c"])
    for r in res.values():
        assert r["source"] == "local" and sources(r) == {0: "local", 1: "local"}, r
        assert r["bytes_fetched"] == 0 and r["reason"] is None, r
    assert all(h["protected"] for h in run["intact_healed"].values()), run["intact_healed"]


def test_wiped_node_restores_from_its_peer_and_heals(run):
    """Node 1 wiped: its rank reads step 3 from node 0, exactly, and the replacement holds
    the step again in full (healed)."""
    res = run["wipe1"]
    check_exact(res, 2, 3, run["log_c"])
    for r in res.values():
        assert r["source"] == "peer" and sources(r) == {0: "local", 1: "peer"}, r
        assert r["bytes_fetched"] > 0, r
    healed = run["wipe1_healed"]
    assert sorted(healed) == [0, 1] and all(h["protected"] for h in healed.values()), healed
    # The replacement node holds the resumed step again, in full.
    assert run["wipe1_after"][1].get(3) == (True, [0, 1]), run["wipe1_after"]


def test_corrupt_on_both_nodes_uses_the_previous_step(run):
    """Step 3 corrupt on both nodes: the resume refuses it, saying why, loads step 2 from
    local copies, and drops the refused step."""
    res = run["corrupt2"]
    check_exact(res, 2, 2, run["log_c"])
    for r in res.values():
        assert "step 3" in r["reason"] and "checksum mismatch" in r["reason"], r["reason"]
    for r in res.values():
        # step 2 is loaded from each node's own copies: nothing of it came from a peer (bytes
        # read while trying the refused step 3 do not make step 2's source "peer")
        assert sources(r) == {0: "local", 1: "local"}, r
    # the refused step is gone (newer than the resumed one), on both nodes
    assert all(3 not in h for h in run["corrupt2_after"].values()), run["corrupt2_after"]


def test_both_nodes_wiped_uses_persistent(run):
    """Both nodes wiped: step 3 is loaded from the persistent tier, exactly."""
    res = run["persist_wiped"]
    check_exact(res, 2, 3, run["log_c"])
    for r in res.values():
        assert r["source"] == "persistent", r
        assert set(sources(r).values()) == {"persistent"}, r


def test_persistent_newer_than_memory_wins(run):
    # saved 2..4, persistent at 4; memory held 4 and 3 until step 4 was deleted on both nodes
    # (and 2 as well when the replicator skipped step 3 for the newer 4: 2 was then the newest
    # step replicated everywhere, which retention keeps)
    """A persistent step newer than anything in memory is loaded, and the reason says so."""
    for h in run["persist_newer_a"].values():
        assert h[4] == (True, [0, 1]) and {3, 4} <= set(h) <= {2, 3, 4}, run["persist_newer_a"]
    res = run["persist_newer"]
    check_exact(res, 2, 4, run["log_c"])
    for r in res.values():
        assert r["source"] == "persistent", r
        assert "persistent step 4" in (r["reason"] or ""), r


def test_nothing_anywhere_starts_fresh(run):
    """No checkpoint anywhere: every rank starts fresh (step None)."""
    res = run["empty"]
    assert sorted(res) == [0, 1], run["log_c"][-8000:]
    for r in res.values():
        assert r["step"] is None and r["source"] is None, r


def test_orphan_steps_are_dropped_when_starting_fresh(run):
    """Steps without metadata (orphans) are never loaded: the job starts fresh, says why,
    and drops them on both nodes."""
    assert run["orphans_before"] == {2: (False, [0, 1]), 3: (False, [0, 1])}
    res = run["orphans"]
    assert sorted(res) == [0, 1], run["log_c"][-8000:]
    for r in res.values():
        assert r["step"] is None and r["source"] is None, r
        assert "step 3" in r["reason"] and "metadata" in r["reason"], r["reason"]
    assert run["orphans_after"] == {0: {}, 1: {}}, run["orphans_after"]


def test_node_dying_mid_save_resumes_previous_step(run):
    """A node SIGKILLed mid-save of step 4: the restart resumes step 3 locally, names the
    missing metadata of step 4, and drops the half-saved step."""
    assert died_of_sigkill(run["log_a"]), run["log_a"][-8000:]
    before = run["midsave_a"]
    # what the crash left: step 4's shards (at least rank 1's), but no metadata anywhere
    for n in (0, 1):
        assert before[n][3] == (True, [0, 1]), before
        assert 4 in before[n] and before[n][4][0] is False, before
    assert any(1 in before[n][4][1] for n in (0, 1)), before
    res = run["midsave"]
    check_exact(res, 2, 3, run["log_c"])
    for r in res.values():
        assert r["source"] == "local", r
        assert "step 4" in r["reason"] and "metadata" in r["reason"], r["reason"]
    # the half-saved step is dropped on both nodes; the resumed one stays
    after = run["midsave_after"]
    assert all(4 not in h and h.get(3) == (True, [0, 1]) for h in after.values()), after


def test_killed_during_recovery_then_resumes(run):
    # C: rank 1 died while rebuilding its own shard of step 3 from node 0's copy
    """A rank SIGKILLed while rebuilding its shard (its bytes landed, not yet verified)
    commits nothing; the next resume reads it again, loads exactly, heals, and leaves no
    partial files."""
    assert died_of_sigkill(run["log_c"]), run["log_c"][-8000:]
    held = run["recovkill_after"][1]
    # the recovery had begun (the metadata came first), the shard never got committed
    assert 3 in held and held[3][0] and 1 not in held[3][1], run["recovkill_after"]
    # D: the next resume fetches it again and loads the exact state
    res = run["recovkill_d"]
    check_exact(res, 2, 3, run["log_d"])
    for r in res.values():
        assert sources(r) == {0: "local", 1: "peer"} and r["bytes_fetched"] > 0, r
    assert all(h["protected"] for h in run["recovkill_d_healed"].values()), run["recovkill_d_healed"]
    after = run["recovkill_d_after"]
    assert after[1].get(3) == (True, [0, 1]), after
    # no debris of the interrupted transfer is left behind
    c = run["c"]
    for n in (0, 1):
        for root, _, files in os.walk(os.path.join(job_dir(c, n, "recovkill"), layout.STEPS)):
            assert not [f for f in files if f.endswith((layout.INFLIGHT, layout.TMP))], (root, files)


# ---------------------------------------------------------------------------- world size changes
def test_two_ranks_resumed_on_four(run):
    """A step saved by 2 ranks resumes on 4 (two new empty nodes), exactly, the new ranks
    reading from the old nodes."""
    res = run["w2"]
    check_exact(res, 4, 2, run["log_b"])
    for r in res.values():
        assert r["source"] in ("local", "peer"), r
    # ranks 2 and 3 started on empty nodes: their part of the state came from nodes 0 and 1
    assert res[0]["bytes_fetched"] > 0, res[0]


def test_four_ranks_resumed_on_two_with_every_shard_present(run):
    """A step saved by 4 ranks resumes on 2 with every shard present across the two nodes:
    resharded reads cross nodes, exactly."""
    before = run["w4_moved_before"]
    assert before[0][3] == (True, [0, 2]) and before[1][3] == (True, [1, 3]), before
    res = run["w4_moved"]
    check_exact(res, 2, 3, run["log_c"])
    for r in res.values():
        # each new rank needs old chunks from both nodes: resharded reads cross nodes
        assert r["source"] == "peer" and r["bytes_fetched"] > 0, r


def test_four_ranks_resumed_on_two_with_missing_shards_falls_back(run):
    # nodes 0 and 1 only ever held shards 0 and 1 (each other's replicas)
    """4 ranks resumed on 2 with shards 2 and 3 in no memory: the persistent step is loaded
    (or a fresh start without one), naming the missing shards."""
    before = run["w4_persist_before"]
    assert all(h[3] == (True, [0, 1]) for h in before.values()), before
    res = run["w4_persist"]
    check_exact(res, 2, 3, run["log_c"])
    for r in res.values():
        assert r["source"] == "persistent", r
        assert "step 3" in r["reason"] and "2, 3" in r["reason"], r["reason"]
    res = run["w4_fresh"]
    assert sorted(res) == [0, 1], run["log_c"][-8000:]
    for r in res.values():
        assert r["step"] is None and r["source"] is None, r
        assert "step 3" in r["reason"] and "2, 3" in r["reason"], r["reason"]


# ---------------------------------------------------------------------------- 2 nodes x 2 ranks
SAVE_2X2 = {
    "x2_wipe": {"first": 2, "last": 3},
    "x2_meta": {"first": 2, "last": 3},
    "x2_badreplica": {"first": 2, "last": 3},
    "x2_killread": {"first": 2, "last": 3},
    # last: saves until the test kills node 1 (agent and both ranks) mid-loop
    "x2_loop": {"first": 0, "last": 10**9, "back_to_back": True},
}
RESUME_2X2 = {"x2_wipe": {"heal": True}, "x2_meta": {}, "x2_badreplica": {"heal": True},
              "x2_loop": {"heal": True},
              # last: rank 3 (replaced node) SIGKILLs itself right after its first peer read
              "x2_killread": {"kill_after_read": 3}}


def flip_metadata_byte(c: Cluster, node: int, name: str, step: int) -> None:
    store = open_store(c, node, name)
    try:
        path = store.paths.metadata(step)
    finally:
        store.close()
    with open(path, "rb") as f:
        raw = f.read()
    flip_byte(path, raw.index(b"\n") + 1 + (len(raw) - raw.index(b"\n") - 1) // 2)  # in the payload


def complete_on(c: Cluster, node: int, name: str, ranks: set[int]) -> list[int]:
    return sorted(s for s, (meta, held) in holdings(c, node, name).items() if meta and ranks <= set(held))


@pytest.fixture(scope="module")
def run2x2():
    with Cluster(2, nproc=2) as c:
        o: dict = {"c": c}
        c.clear_results()
        c.start("rec_jobs.py", specs(c, SAVE_2X2))
        deadline = time.time() + LAUNCH_TIMEOUT
        # wait until the loop job has a few complete steps, each held by both nodes
        while (len(complete_on(c, 0, "x2_loop", {0, 1, 2, 3})) < 2
               or max(complete_on(c, 0, "x2_loop", {0, 1}) or [0]) < 5):
            assert time.time() < deadline, f"the save loop made no progress:\n{c.logs()}"
            assert all(n.proc.poll() is None for n in c.nodes), f"a node exited:\n{c.logs()}"
            time.sleep(0.1)
        o["killed"] = lose_node(c.nodes[1])  # node 1 dies wherever its ranks are
        # node 0's ranks fail in their next collective, in seconds (a hang fails here, with logs)
        o["loop_node0_exit"] = c.wait(60, nodes=[0])
        c.kill_all()
        kill_strays(c)
        o["loop_node0"] = holdings(c, 0, "x2_loop")
        o["loop_expected"] = max(complete_on(c, 0, "x2_loop", {0, 1, 2, 3}))

        for name in ("x2_wipe", "x2_loop", "x2_killread"):
            wipe_job(c, 1, name)  # replacement machine
        flip_metadata_byte(c, 1, "x2_meta", 3)
        # node 1's copy of rank 0's shard
        with contextlib.closing(open_store(c, 1, "x2_badreplica")) as store:
            o["badreplica_key"] = damage_shard(store, 3, 0).key

        o["log"] = launch(c, 2, RESUME_2X2, dies=1)
        for name in RESUME_2X2:
            o[name] = results(c, "resume", name)
            o[f"{name}_healed"] = results(c, "healed", name)
            o[f"{name}_after"] = {n: holdings(c, n, name) for n in (0, 1)}
        store = open_store(c, 1, "x2_meta")
        try:
            o["meta_reverified"] = store.metadata.read(3)[0].ranks
        finally:
            store.close()

        # the job whose resume was killed mid-load resumes again
        o["log_killread"] = launch(c, 2, {"x2_killread": {"heal": True}})
        o["killread_again"] = results(c, "resume", "x2_killread")
        o["killread_healed"] = results(c, "healed", "x2_killread")
        o["killread_after"] = {n: holdings(c, n, "x2_killread") for n in (0, 1)}
        yield o


def test_2x2_wiped_node_fetches_for_both_its_ranks(run2x2):
    """2 x 2: node 1 wiped, both its ranks fetch from node 0, exactly, and node 1 holds every
    shard again after the heal."""
    res = run2x2["x2_wipe"]
    check_exact(res, 4, 3, run2x2["log"])
    for r in res.values():
        assert sources(r) == {0: "local", 1: "local", 2: "peer", 3: "peer"}, r
        assert r["source"] == "peer" and r["bytes_fetched"] > 0, r
    healed = run2x2["x2_wipe_healed"]
    assert sorted(healed) == [0, 1, 2, 3] and all(h["protected"] for h in healed.values()), healed
    assert run2x2["x2_wipe_after"][1].get(3) == (True, [0, 1, 2, 3]), run2x2["x2_wipe_after"]


def test_2x2_corrupt_metadata_copy_is_fetched_again(run2x2):
    """A corrupt metadata copy on node 1 is replaced by a verified one; every shard is still
    read locally."""
    res = run2x2["x2_meta"]
    check_exact(res, 4, 3, run2x2["log"])
    for r in res.values():
        assert set(sources(r).values()) == {"local"} and r["bytes_fetched"] == 0, r
    assert run2x2["meta_reverified"] == [0, 1, 2, 3]


def test_2x2_corrupt_replica_is_refused_and_rebuilt(run2x2):
    """A corrupt replica on node 1 is refused (the reason names it), the read retried from
    node 0, and the replica pushed again by its owner."""
    res = run2x2["x2_badreplica"]
    check_exact(res, 4, 3, run2x2["log"])
    for r in res.values():
        # Node 1's ranks read rank 0's shard too (DCP saved the replicated tensors once, there):
        # its replica on node 1 first, the nearest place, whose damage is found and refused.
        # With data parallelism's copies off (whole replicas), no copy of those items is kept
        # on node 1: the retry reads them from node 0.
        src = sources(r)
        assert src[0] == src[1] == "local" and "peer" in (src[2], src[3]), r
        assert r["bytes_fetched"] > 0, r
        assert "step 3" in r["reason"] and "checksum mismatch" in r["reason"], r["reason"]
        assert "rank 0" in r["reason"], r["reason"]
    healed = run2x2["x2_badreplica_healed"]
    assert all(h["protected"] for h in healed.values()), healed
    # the replica was pushed again by its owner: node 1 holds every shard of step 3 again
    assert run2x2["x2_badreplica_after"][1].get(3) == (True, [0, 1, 2, 3])


def test_2x2_node_killed_mid_save_loop(run2x2):
    """Node 1 SIGKILLed in a back-to-back save loop: node 0 fails in its next collective, and
    the restart resumes the newest step node 0 held whole, exactly."""
    assert len(run2x2["killed"]) >= 3, run2x2["killed"]  # the agent and both ranks
    assert run2x2["loop_node0_exit"] != [0], run2x2["loop_node0_exit"]  # the survivor failed
    expected = run2x2["loop_expected"]
    assert expected >= 1, run2x2["loop_node0"]
    res = run2x2["x2_loop"]
    # the newest step that survived whole on node 0 (own shards, replicas and metadata)
    check_exact(res, 4, expected, run2x2["log"])
    for r in res.values():
        assert sources(r) == {0: "local", 1: "local", 2: "peer", 3: "peer"}, r
    assert all(h["protected"] for h in run2x2["x2_loop_healed"].values())
    after = run2x2["x2_loop_after"]
    for n in (0, 1):
        assert max(after[n]) == expected and after[n][expected] == (True, [0, 1, 2, 3]), after


def test_2x2_killed_mid_load_then_resumes(run2x2):
    """A rank SIGKILLed right after its first peer read aborts the whole resume; the next one
    loads exactly and heals."""
    assert died_of_sigkill(run2x2["log"]), run2x2["log"][-8000:]
    # rank 3 never finished its resume; the others could not either (it is collective)
    assert run2x2["x2_killread"] == {}, run2x2["x2_killread"]
    res = run2x2["killread_again"]
    check_exact(res, 4, 3, run2x2["log_killread"])
    for r in res.values():
        src = sources(r)
        # node 0's ranks read their own copies; the replaced node's ranks read from node 0
        # (at least one of them: a copy the killed attempt committed may serve the other)
        assert src[0] == src[1] == "local" and "peer" in (src[2], src[3]), r
        assert r["bytes_fetched"] > 0, r
    assert all(h["protected"] for h in run2x2["killread_healed"].values()), run2x2["killread_healed"]
    assert run2x2["killread_after"][1].get(3) == (True, [0, 1, 2, 3]), run2x2["killread_after"]


def test_replaced_node_recovers_over_the_process_group_transport():
    """Recovery over replication="pg": the replaced node's rank streams its shard from the
    partner (read_items over gloo), then rebuilds its tmpfs copy (paced read_items over gloo)."""
    with Cluster(2, 1) as c:
        c.run("save_resume.py", "0", "2", "async", "0", "pg", timeout=LAUNCH_TIMEOUT)
        assert all(r["protected"] for r in c.results("protected").values())
        c.nodes[1].wipe()
        c.run("save_resume.py", "3", "2", "async", "0", "pg", timeout=LAUNCH_TIMEOUT)
        res = c.results("resume")
        assert all(r["step"] == 2 and r["match"] for r in res.values()), res
        assert res[0]["sources"] == {"0": "local", "1": "peer"}, res
        assert res[0]["bytes_fetched"] > 0
        assert all(r["protected"] for r in c.results("healed").values())  # replicas rebuilt
        store = LocalStore(c.nodes[1].local_dir, c.job_id, create=False)
        assert store.inventory.step_state(2).committed_ranks == {0, 1}
        store.verify_shard(2, 1)  # node 1's own shard is back in its memory, intact

"""Elastic restarts: a job resumes into another shape (nodes x ranks per node) from memory.

One cluster of two simulated nodes (torchrun agent and tmpfs dir each) hosts three jobs,
each its own job id, in four launches:

  1  1 node  x 2 ranks: "grow" saves (one node: nothing to replicate to)
  2  2 nodes x 2 ranks: "grow" resumes with node 1 empty; "reshape" saves; "shrink" saves,
     then node 1 is SIGKILLed whole while the job runs (node 0's ranks are killed after it)
  3  1 node  x 2 ranks: "shrink" resumes on the surviving node (node 1's memory is gone)
  4  2 nodes x 1 rank : "reshape" resumes

Each resume must load the newest step every partner acknowledged, from memory, bit-exact
against the saved tensors, with every rank agreeing, and ``ResumeInfo.resharded`` set.

A fourth job, "resize", rides along in launches 2 to 4 (2 x 2 -> 1 x 2 -> 2 x 1, saving a few
steps of 16 MiB after each resume): afterwards neither node may hold a shard of the earlier
shapes' ranks or steps, nor a recycled buffer of them, and each node's tmpfs is within the
bound docs/operations.md states.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
from cluster import WORKERS, Cluster, free_port, kill_strays, lose_node
from helpers import wait_for

from mlcheckpoint.store.layout import classify

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

LAUNCH_TIMEOUT = 180
LAST = 3  # every job saves steps 1..LAST before its restart
RESIZE_MIB = 16  # the "resize" job's checkpoint, about
KEEP = 2  # the manager's default keep


def specs(c: Cluster, table: dict[str, dict]) -> str:
    return json.dumps([dict(spec, job=c.sub_job(name)) for name, spec in table.items()])


def launch(c: Cluster, nnodes: int, nproc: int, table: dict[str, dict]) -> None:
    """One launch of elastic_job.py on nodes 0..nnodes-1 with ``nproc`` ranks each; every
    node must exit 0."""
    c.clear_results()
    c.nproc = nproc  # the next launch's ranks per node
    nodes = list(range(nnodes))
    c.start("elastic_job.py", specs(c, table), nodes=nodes, nnodes=nnodes)
    codes = c.wait(LAUNCH_TIMEOUT, nodes=nodes)
    assert codes == [0] * nnodes, f"exit codes {codes}; logs:\n{c.logs()}"


def wait_for_reports(c: Cluster, kind: str, name: str, ranks: int) -> dict[int, dict]:
    """The launch's reports of ``kind`` for job ``name`` from all ``ranks`` (fails with the
    logs if a node exits or the reports take too long)."""
    def reports() -> dict[int, dict] | None:
        assert all(n.proc is None or n.proc.poll() is None for n in c.nodes), \
            f"a node exited:\n{c.logs()}"
        res = c.sub_job_results(kind, name)
        return res if len(res) >= ranks else None

    return wait_for(reports, f"{kind} reports from every rank", LAUNCH_TIMEOUT, 0.2, c.logs)


@pytest.fixture(scope="module")
def run():
    with Cluster(2, nproc=2) as c:
        o: dict = {}
        save = {"first": 1, "last": LAST}

        launch(c, 1, 2, {"grow": save})
        o["grow_acked"] = c.sub_job_results("acked", "grow")

        # 2 x 2: "shrink" holds after its saves, and node 1 dies under it.
        c.clear_results()
        c.nproc = 2
        c.start("elastic_job.py", specs(c, {"grow": {"first": 1, "last": 0}, "reshape": save,
                                             "resize": dict(save, mib=RESIZE_MIB),
                                             "shrink": dict(save, hold=True)}))
        o["shrink_acked"] = wait_for_reports(c, "acked", "shrink", 4)
        o["grow"] = c.sub_job_results("resume", "grow")
        o["reshape_acked"] = c.sub_job_results("acked", "reshape")
        lose_node(c.nodes[1])
        c.kill_all()  # node 0's ranks would only learn of it in their next collective
        kill_strays(c)
        shutil.rmtree(c.sub_job_dir(1, "shrink"))  # the lost machine's memory is gone too

        # "resize" goes on in each shape for more than ``keep`` saves (node 1 idles meanwhile)
        launch(c, 1, 2, {"shrink": {"first": 1, "last": 0},
                         "resize": {"first": LAST + 1, "last": LAST + 4, "mib": RESIZE_MIB}})
        o["shrink"] = c.sub_job_results("resume", "shrink")
        o["resize_1x2"] = c.sub_job_results("resume", "resize")

        launch(c, 2, 1, {"reshape": {"first": LAST + 1, "last": LAST + 1},
                         "resize": {"first": LAST + 5, "last": LAST + 8, "mib": RESIZE_MIB}})
        o["reshape"] = c.sub_job_results("resume", "reshape")
        o["reshape_after"] = c.sub_job_results("acked", "reshape")
        o["resize_2x1"] = c.sub_job_results("resume", "resize")
        o["resize_acked"] = c.sub_job_results("acked", "resize")
        o["resize_nodes"] = [held_by(c, k, "resize") for k in range(2)]
        o["logs"] = c.logs()
        yield o


def held_by(c: Cluster, node: int, name: str) -> dict:
    """What job ``name`` holds on ``node``: committed shards per step, every owner with a
    recycled buffer, the bytes its files take, and the data bytes of its newest step here."""
    store = c.sub_job_store(node, name)
    try:
        steps = {s: sorted(store.inventory.step_state(s).committed_ranks) for s in store.inventory.steps()}
        newest = max(steps, default=None)
        pooled = {classify(n).rank for n in os.listdir(store.pool_dir)}
        return {"steps": steps, "pool": sorted(r for r in pooled if r is not None),
                "usage": store.capacity.usage_bytes(),
                "step_bytes": sum(store.shards.read_manifest(newest, r).data_bytes
                                  for r in steps.get(newest, [])),
                "files": sorted(os.path.relpath(os.path.join(d, f), store.job_dir)
                                for d, _, fs in os.walk(store.job_dir) for f in fs)}
    finally:
        store.close()


def newest_acked(acked: dict[int, dict]) -> int:
    """The newest step that every rank saw acknowledged."""
    steps = [set(r["steps"]) for r in acked.values()]
    return max(set.intersection(*steps))


def check_resumed(res: dict[int, dict], world: int, step: int, logs: str) -> None:
    assert sorted(res) == list(range(world)), f"ranks reporting: {sorted(res)}\n{logs[-8000:]}"
    for rank, r in res.items():
        assert r["step"] == step, (rank, r)
        assert r["source"] in ("local", "peer"), (rank, r)  # from memory, not persistent
        assert r["match"] and not r["mismatch"], (rank, r)  # bit-exact, every rank
        assert r["world"] == world and r["resharded"] is True, (rank, r)


def test_shrink_after_losing_a_node_resumes_on_the_survivor(run):
    """2 x 2 -> 1 x 2: node 0 holds node 1's ranks' shards as their partner."""
    assert sorted(run["shrink_acked"]) == [0, 1, 2, 3]
    step = newest_acked(run["shrink_acked"])
    assert step == LAST
    check_resumed(run["shrink"], 2, step, run["logs"])
    for r in run["shrink"].values():
        assert r["source"] == "local", r  # one node: nothing to fetch from


def test_reshape_to_fewer_ranks_per_node(run):
    """2 x 2 -> 2 x 1."""
    step = newest_acked(run["reshape_acked"])
    assert step == LAST
    check_resumed(run["reshape"], 2, step, run["logs"])
    # the job goes on in its new shape: its next save is replicated again
    assert all(r["steps"] == [LAST + 1] for r in run["reshape_after"].values()), run["reshape_after"]


def test_after_2x2_1x2_2x1_no_shard_of_a_retired_step_or_rank_is_left(run):
    """2 x 2 (steps 1-3) -> 1 x 2 on node 0 (4-7) -> 2 x 1 (8-11). Each node ends with the
    2 x 1 job's newest ``keep`` steps: its rank's shards and its partner's replicas (ranks 0
    and 1) and nothing of the earlier shapes (ranks 2, 3, steps 1-7, their recycled
    buffers), within docs/operations.md's bound: (keep + 2) x the bytes one step puts on the
    node, when nothing is in flight and replication kept up."""
    assert all(r["match"] and r["resharded"] for r in run["resize_1x2"].values()), run["resize_1x2"]
    assert all(r["match"] for r in run["resize_2x1"].values()), run["resize_2x1"]  # world 2 again
    assert [run["resize_1x2"][0]["step"], run["resize_2x1"][0]["step"]] == [LAST, LAST + 4]
    last = LAST + 8
    assert all(last in r["steps"] for r in run["resize_acked"].values()), run["resize_acked"]
    for node, held in enumerate(run["resize_nodes"]):
        steps = {int(s): ranks for s, ranks in held["steps"].items()}
        where = f"node {node} holds {steps}, pool of ranks {held['pool']}, files {held['files']}"
        bound = (KEEP + 2) * held["step_bytes"] + (1 << 20)  # + manifests, metadata, history
        print(f"\nnode {node}: {held['usage'] / 2**20:.1f} MiB in tmpfs, bound "
              f"{bound / 2**20:.1f} MiB (one step here: {held['step_bytes'] / 2**20:.1f} MiB)")
        assert all(set(ranks) <= {0, 1} for ranks in steps.values()), where
        assert min(steps) > LAST + 4, where  # nothing of the 2 x 2 or 1 x 2 saves
        assert steps[last] == [0, 1] and len(steps) <= KEEP + 1, where
        assert set(held["pool"]) <= {0, 1}, where
        assert held["step_bytes"] >= RESIZE_MIB * 2**20 * 0.9, held  # the whole checkpoint
        assert held["usage"] <= bound, where


def test_grow_onto_an_empty_node(run):
    """1 x 2 -> 2 x 2: node 1 starts empty, its ranks read their part from node 0."""
    step = newest_acked(run["grow_acked"])
    assert step == LAST
    check_resumed(run["grow"], 4, step, run["logs"])
    assert {r["source"] for r in run["grow"].values()} == {"peer"}, run["grow"]


# ---------------------------------------------------------------------------- a real elastic launch
def start_elastic_agent(c: Cluster, node: int, port: int, spec: dict, env: dict[str, str]) -> None:
    """torchrun's elastic agent on simulated ``node``: ``--nnodes=1:2`` over the c10d
    rendezvous at ``port``, restarting its workers when a rank fails or the membership
    changes. Every agent here runs on the endpoint's host, and the first to bind the port
    hosts the rendezvous store: node 0 starts first, so losing node 1 leaves the store up."""
    n = c.nodes[node]
    e = dict(os.environ, MLCHECKPOINT_LOCAL_DIR=n.local_dir, TEST_OUT_DIR=c.out_dir,
             TEST_PERSISTENT_DIR=c.persistent_dir, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
             **env)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2",
           f"--nproc-per-node={c.nproc}", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={c.job_id}", "--max-restarts=2",
           "--monitor-interval=0.5", "--rdzv-conf=last_call_timeout=2,join_timeout=120",
           os.path.join(WORKERS, "elastic_job.py"), json.dumps([spec])]
    with open(n.log_path, "a") as logf:
        n.proc = subprocess.Popen(cmd, env=e, stdout=logf, stderr=subprocess.STDOUT,
                                  start_new_session=True)


def wait_for_listener(port: int, c: Cluster) -> None:
    def listening() -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    wait_for(listening, "node 0's agent to listen", LAUNCH_TIMEOUT, 0.1, c.logs)


def wait_for_steps(c: Cluster, name: str, ranks: int, count: int) -> int:
    """Wait until each of ``ranks`` reported ``count`` acknowledged steps of incarnation
    ``name``; return the newest step all of them saw acknowledged."""
    def enough() -> dict[int, dict] | None:
        res = wait_for_reports(c, "acked", name, ranks)
        return res if min(len(r["steps"]) for r in res.values()) >= count else None

    return newest_acked(wait_for(enough, f"progress in {name}", LAUNCH_TIMEOUT, 0.2, c.logs))


def test_torchrun_elastic_grow_then_shrink():
    """A real ``torchrun --nnodes=1:2`` job: it starts on node 0 alone (1 x 2); node 1 joins
    and the agents restart the workers as 2 x 2, which resume from node 0's memory; then node
    1 dies and node 0's agent restarts its workers as 1 x 2, which resume from memory again
    (node 0 holds node 1's shards as its partner). Each resume loads at least the newest step
    acknowledged before the change, bit-exact and resharded."""
    with Cluster(2, nproc=2) as c:
        job = "torchrun"
        spec = {"job": c.sub_job(job), "loop": 2, "ack_timeout": 10}
        # torch 2.13's agents share their rendezvous store with the workers by default, and a
        # node joining a running job then never gets past the rendezvous (docs/operations.md)
        env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        port = free_port()
        start_elastic_agent(c, 0, port, spec, env)
        alone = wait_for_steps(c, f"{job}-r0-w2", 2, 3)
        wait_for_listener(port, c)
        start_elastic_agent(c, 1, port, spec, env)  # a membership change: not a restart
        grown = wait_for_steps(c, f"{job}-r0-w4", 4, 2)
        lose_node(c.nodes[1])
        shutil.rmtree(c.nodes[1].local_dir)  # the machine is gone, and its memory with it
        codes = c.wait(LAUNCH_TIMEOUT, nodes=[0])
        logs = c.logs()
        assert codes == [0], f"exit codes {codes}; logs:\n{logs}"

        res = c.sub_job_results("resume", f"{job}-r0-w4")
        step = res[0]["step"]
        assert step >= alone, (step, alone, res)
        check_resumed(res, 4, step, logs)
        assert {r["source"] for r in res.values()} == {"peer"}, res  # node 1 started empty

        res = c.sub_job_results("resume", f"{job}-r1-w2")
        step = res[0]["step"]
        # node 0 may have saved and protected a newer step between the last report and the kill
        assert step >= grown, (step, grown, res)
        check_resumed(res, 2, step, logs)
        after = c.sub_job_results("acked", f"{job}-r1-w2")
        assert all(r["steps"] == [step + 1, step + 2] for r in after.values()), after

"""The simulated clusters (mlcheckpoint.testing) and a job that loses a node over the network.

- The loopback harness (``cluster.Cluster``, which NetCluster builds on): agents started on
  every node with the node's environment, per-rank results, a lost node's processes all gone
  and its memory wiped, and nothing left after ``close``.
- The network harness: namespaces, addresses, loopback, tbf at the requested rate on both ends of
  every link, connectivity between nodes, nothing in the host's namespace, and nothing left
  afterwards: not when the body raises, not on SIGTERM, not after a crash (clean_stale).
- A 2-node x 2-rank job over a 300 mbit link loses node 1 (SIGKILL, memory wiped); the
  restarted job's node-1 ranks resume from node 0's replicas, bit-exact.

No timing is asserted anywhere: speed is measured by benchmarks only.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from helpers import from_another_node, wait_for

from mlcheckpoint.testing import netcluster
from mlcheckpoint.testing.cluster import Cluster, is_dead, process_tree
from mlcheckpoint.testing.netcluster import NetCluster, parse_rate, tbf_params

REASON = netcluster.available()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"no emulated network: {REASON}")
WORKER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "workers", "net_resume.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def ip_json(*args: str) -> list[dict]:
    out = subprocess.run(["ip", "-j", *args], capture_output=True, text=True, check=True).stdout
    return json.loads(out) if out.strip() else []


def tc_qdiscs(netns: str, dev: str) -> list[dict]:
    """The qdiscs of ``dev`` in ``netns``, with their counters."""
    out = subprocess.run(["tc", "-s", "-j", "-n", netns, "qdisc", "show", "dev", dev],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out) if out.strip() else []


def netns_names() -> list[str]:
    return [ns["name"] for ns in ip_json("netns", "list")]


def running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def assert_nothing_left(name: str, root: str, pids: set[int]) -> None:
    assert not [ns for ns in netns_names() if ns.startswith(name + "-")]
    assert not [p for p in pids if running(p)]
    assert not os.path.exists(root)


# --------------------------------------------------------------------------- no root needed
def test_rates_parse_and_buckets_fit_a_gso_segment():
    assert parse_rate("1gbit") == 10**9
    assert parse_rate("500mbit") == 500 * 10**6
    assert parse_rate("2.5gbit") == 2_500_000_000
    assert parse_rate(123) == 123
    assert parse_rate(None) is None
    for bad in ("fast", "1gbps", "0mbit", "-1gbit"):
        with pytest.raises(ValueError):
            parse_rate(bad)
    for bits in (10**6, 10**9, 10**10):
        burst, limit = tbf_params(bits)
        assert burst >= 128 * 1024 and burst >= bits // 8 // 1000 and limit > burst


# --------------------------------------------------------------------------- the harness
@pytest.mark.slow  # its throughput probe runs Python in the namespaces
@needs_netns
def test_layout_shaping_and_connectivity():
    """NetCluster's namespaces, addresses and tbf shaping are as documented, nodes reach each
    other, the host's namespace gets nothing, and close() leaves nothing."""
    host_links = sorted(link["ifname"] for link in ip_json("link", "show"))
    host_routes = ip_json("route", "show")
    with NetCluster(nodes=3, rate="300mbit") as c:
        name, root = c.name, c.root
        assert set(netns_names()) >= {c.switch_netns, *(n.netns for n in c.nodes)}
        # The host's own namespace got nothing: no interface, no route.
        assert sorted(link["ifname"] for link in ip_json("link", "show")) == host_links
        assert ip_json("route", "show") == host_routes
        for k, node in enumerate(c.nodes):
            assert c.address(k) == node.address == f"10.213.0.{k + 1}"
            (eth0,) = ip_json("-n", node.netns, "-4", "addr", "show", "dev", "eth0")
            assert [(a["local"], a["prefixlen"]) for a in eth0["addr_info"]] == [(node.address, 24)]
            (lo,) = ip_json("-n", node.netns, "link", "show", "lo")
            assert "UP" in lo["flags"]
            assert os.path.isdir(node.local_dir) and node.local_dir.startswith(root)
            # Shaped both ways: what the node sends (eth0) and what it receives (its port).
            for netns, dev in ((node.netns, "eth0"), (c.switch_netns, node.port)):
                (q,) = tc_qdiscs(netns, dev)
                assert q["kind"] == "tbf" and q["options"]["rate"] == 300 * 10**6 // 8, q
        # Every node reaches every other (bytes arrive in full; how fast is not asserted).
        for src, dst in ((0, 1), (1, 2), (2, 0)):
            raw = c.raw_tcp_transfer(src, dst, 1 << 20, into_tmpfs=src == 1)
            assert raw.nbytes == 1 << 20 and raw.bytes_per_s > 0
            assert raw.sender_cpu_s >= 0 and raw.receiver_cpu_s >= 0
        assert os.listdir(c.nodes[2].local_dir) == []  # the receiver's tmpfs file went with it

        c.set_rate(None)
        assert all(q["kind"] != "tbf" for q in tc_qdiscs(c.nodes[0].netns, "eth0"))
        c.set_rate("5gbit")
        assert tc_qdiscs(c.switch_netns, "p1")[0]["options"]["rate"] == 5 * 10**9 // 8
    assert_nothing_left(name, root, set())


@needs_netns
def test_lose_one_node_and_its_memory():
    with NetCluster(nodes=2) as c:
        for k in (0, 1):
            # The forked sleep leaves the process group and session: only the namespace holds it.
            c.run_in(k, ["sh", "-c", "setsid sleep 600 & exec sleep 600"])
        wait_for(lambda: len(c.node(0).pids()) == 2 and len(c.node(1).pids()) == 2, "sleeps")
        survivors = c.node(0).pids()
        with open(os.path.join(c.node(1).local_dir, "shard"), "w") as f:
            f.write("x")

        lost = c.node(1).kill()
        assert len(lost) == 2 and not [p for p in lost if running(p)]
        assert not c.node(1).pids() and c.node(0).pids() == survivors
        assert os.listdir(c.node(1).local_dir) == ["shard"]  # memory survives until wiped
        c.node(1).wipe()
        assert os.listdir(c.node(1).local_dir) == []
    assert not [p for p in survivors if running(p)]


@needs_netns
def test_nothing_left_when_the_body_raises():
    pids: set[int] = set()
    with pytest.raises(RuntimeError, match="boom"), NetCluster(nodes=2, rate="1gbit") as c:
        name, root = c.name, c.root
        for k in (0, 1):
            c.run_in(k, ["sh", "-c", "setsid sleep 600 & exec sleep 600"])
        wait_for(lambda: len(c.node(0).pids()) + len(c.node(1).pids()) == 4, "sleeps")
        pids = c.node(0).pids() | c.node(1).pids()
        raise RuntimeError("boom")
    assert len(pids) == 4
    assert_nothing_left(name, root, pids)


@needs_netns
def test_nothing_left_when_setup_fails(monkeypatch):
    def tc_fails(self, rate):
        raise RuntimeError("tc failed")

    ours = f"{netcluster.PREFIX}{os.getpid()}-"
    before = [ns for ns in netns_names() if ns.startswith(ours)]
    with pytest.raises(ValueError):
        NetCluster(nodes=2, rate="fast")
    monkeypatch.setattr(NetCluster, "set_rate", tc_fails)  # after the namespaces and links
    with pytest.raises(RuntimeError, match="tc failed"):
        NetCluster(nodes=2, rate="1gbit")
    assert [ns for ns in netns_names() if ns.startswith(ours)] == before == []
    assert not [d for d in os.listdir("/dev/shm") if d.startswith(ours)]


# A process that builds a cluster, starts a process in each node, says so and waits; the test
# then ends it with SIGTERM, or it SIGKILLs itself (a crash: nothing of ours runs).
CHILD = textwrap.dedent("""
    import json, os, signal, sys, time
    from mlcheckpoint.testing.netcluster import NetCluster
    c = NetCluster(nodes=2, rate="500mbit")
    procs = [c.run_in(k, ["sleep", "600"]) for k in (0, 1)]
    while len(c.node(0).pids()) + len(c.node(1).pids()) < 2:
        time.sleep(0.02)
    print(json.dumps({"name": c.name, "root": c.root, "pids": [p.pid for p in procs]}), flush=True)
    if sys.argv[1] == "crash":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)
""")


def start_child(how: str) -> tuple[subprocess.Popen, dict]:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    child = subprocess.Popen([sys.executable, "-c", CHILD, how], stdout=subprocess.PIPE,
                             text=True, env=env)
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line, f"child exited {child.wait()}"
    return child, json.loads(line)


@pytest.mark.slow
@needs_netns
def test_sigterm_cleans_up():
    """A process holding a NetCluster that dies of SIGTERM removes its namespaces, processes
    and directory."""
    child, made = start_child("term")
    try:
        assert all(running(p) for p in made["pids"])
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=60) == -signal.SIGTERM
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert_nothing_left(made["name"], made["root"], set(made["pids"]))


@pytest.mark.slow
@needs_netns
def test_stale_leftovers_of_a_crashed_run_are_cleaned():
    """What a SIGKILLed process left (namespaces, processes, directory) is removed by
    clean_stale()."""
    child, made = start_child("crash")
    assert child.wait(timeout=60) == -signal.SIGKILL
    # The crash left everything: namespaces, the processes inside, the directory.
    assert any(ns.startswith(made["name"] + "-") for ns in netns_names())
    assert os.path.isdir(made["root"])
    netcluster.clean_stale()
    assert_nothing_left(made["name"], made["root"], set(made["pids"]))


# --------------------------------------------------------------------------- a job on it
@needs_netns
@pytest.mark.slow
def test_lost_node_resumes_from_its_partner_over_a_shaped_link():
    """A 2 x 2 job on shaped links: replication listens on each node's own address, and a
    lost node resumes step 3 exactly, its shards coming down its link."""
    with NetCluster(nodes=2, nproc=2, rate="300mbit") as c:
        name, root = c.name, c.root
        # Steps 0-3, each replicated before the next; the job then keeps running.
        c.start(WORKER, "0", "3", "hold")
        saved = wait_for(lambda: len(c.results("saved")) == 4 and c.results("saved"),
                         "steps 0-3 saved and replicated", timeout=180, diag=c.logs)
        first_launch = c.node(0).pids() | c.node(1).pids()  # agents and ranks
        fresh = c.results("resume")
        for rank in range(4):
            assert fresh[rank]["step"] is None, fresh[rank]
            assert saved[rank]["protected"] == {str(s): True for s in range(4)}, c.logs()
            # Each rank listens on its own node's address (not loopback, not another node's).
            assert saved[rank]["address"].rsplit(":", 1)[0] == c.address(rank // 2)

        c.node(1).kill()  # node 1 dies: agent and ranks SIGKILLed
        c.node(1).wipe()  # and a replacement comes up with empty memory
        c.node(0).kill()  # the scheduler stops the survivors; node 0's memory stays
        c.clear_results()
        # Bytes the switch has sent down node 1's link so far (its receive side, shaped).
        received_before = tc_qdiscs(c.switch_netns, c.node(1).port)[0]["bytes"]

        c.start(WORKER, "4", "5")
        codes = c.wait(timeout=240)
        assert codes == [0, 0], c.logs()
        resumed, after = c.results("resume"), c.results("saved")
        assert sorted(resumed) == [0, 1, 2, 3], c.logs()
        for rank in range(4):
            r = resumed[rank]
            assert r["step"] == 3, r  # the newest step replicated before the loss
            # Where each rank's bytes came from (the same job-wide view on every rank).
            assert r["source"] == "peer"
            assert from_another_node(r["sources"], [2, 3]) and len(r["sources"]) == 4, r
            assert r["bytes_fetched"] >= 2 * (4 << 20)  # node 1's two 4 MiB shards, at least
            assert r["match"], r["mismatch"]
            # Bit-exact against what this rank saved before its node was lost.
            assert r["digests"] == saved[rank]["digests"]["3"]
            assert r["address"].rsplit(":", 1)[0] == c.address(rank // 2)
            assert after[rank]["protected"] == {"4": True, "5": True}
        # The shards node 1 fetched came down its shaped link.
        received = tc_qdiscs(c.switch_netns, c.node(1).port)[0]["bytes"] - received_before
        assert received >= resumed[2]["bytes_fetched"]
        second_launch = {p.pid for p in (c.node(0).proc, c.node(1).proc) if p is not None}
    assert len(first_launch) >= 6  # 2 agents + 4 ranks
    assert_nothing_left(name, root, first_launch | second_launch)


# --------------------------------------------------------------------------- loopback harness
NODE_SCRIPT = textwrap.dedent("""
    import os, sys, time
    from mlcheckpoint.testing.cluster import write_result
    rank = int(os.environ["RANK"])
    with open(os.path.join(os.environ["MLCHECKPOINT_LOCAL_DIR"], f"mem{rank}"), "w") as f:
        f.write("x")  # what the node holds in memory
    write_result(sys.argv[1], rank, {"node": int(os.environ["GROUP_RANK"]),
                                     "job": os.environ["MLCHECKPOINT_JOB_ID"]})
    if sys.argv[2] == "hang" and os.environ["GROUP_RANK"] == "1":
        time.sleep(600)  # until the test loses this node
""")


@pytest.mark.slow
def test_loopback_cluster_starts_loses_and_cleans_up(tmp_path):
    """The loopback Cluster: ranks get their node's dir and job id, losing a node kills its
    agent and ranks, wipe empties it, and close() leaves no process or dir."""
    script = tmp_path / "node.py"
    script.write_text(NODE_SCRIPT)
    env = {"PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    with Cluster(2, nproc=2) as c:
        c.run(str(script), "first", "exit", env=env, timeout=300)
        results = c.results("first")
        assert sorted(results) == [0, 1, 2, 3]
        assert {r: v["node"] for r, v in results.items()} == {0: 0, 1: 0, 2: 1, 3: 1}
        assert {v["job"] for v in results.values()} == {c.job_id}
        assert sorted(os.listdir(c.nodes[1].local_dir)) == ["mem2", "mem3"]

        c.clear_results()
        c.start(str(script), "second", "hang", env=env)
        wait_for(lambda: len(c.results("second")) == 4, "every rank's result",
                 diag=c.logs)
        pids = c.nodes[1].kill()  # the agent and both ranks (sessions of their own)
        assert len(pids) >= 3 and all(is_dead(p) for p in pids)
        c.nodes[1].wipe()
        assert os.listdir(c.nodes[1].local_dir) == []
        node0 = c.nodes[0].proc
        assert node0 is not None
        survivors = process_tree(node0.pid)  # node 0's agent waits for node 1 at torchrun's exit barrier
        root = c.root
    assert all(is_dead(p) for p in survivors) and not os.path.exists(root)

"""The network replication uses (replication/core/network.py): which address the TCP listener
binds and advertises, the rule that refuses a loopback address between hosts, and both in a
real 2-node job inside a network namespace of its own."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from cluster import WORKERS, Cluster, free_port

from mlcheckpoint import ConfigError
from mlcheckpoint.replication.core.network import (
    BY_HOST,
    BY_INTERFACE,
    BY_ROUTE,
    Endpoint,
    check_advertisable,
    choose_endpoint,
    interface_address,
    interface_ipv4,
    unreachable_advertisement,
)


# --------------------------------------------------------------------------- the rule
@pytest.mark.parametrize("advertised, master, nodes, refused", [
    ("127.0.0.1", "10.0.0.1", 2, True),     # the nodes are on different hosts
    ("127.0.1.1", "10.0.0.1", 4, True),     # any loopback address
    ("0.0.0.0", "10.0.0.1", 2, True),       # names no host: a peer would connect to itself
    ("localhost", "10.0.0.1", 2, True),
    ("::1", "fd00::1", 2, True),
    ("127.0.0.1", "node001", 2, True),      # a host name other than localhost counts as remote
    ("127.0.0.1", "127.0.0.1", 2, False),   # every node on this machine (simulated clusters)
    ("127.0.0.1", "127.0.1.1", 2, False),
    ("127.0.0.1", "localhost", 2, False),
    ("127.0.0.1", "::1", 2, False),
    ("127.0.0.1", "10.0.0.1", 1, False),    # one node: nobody to reach it
    ("10.0.0.2", "10.0.0.1", 2, False),
    ("10.0.0.1", "127.0.0.1", 2, False),
])
def test_a_loopback_address_is_refused_only_between_hosts(advertised, master, nodes, refused):
    assert unreachable_advertisement(advertised, master, nodes) is refused


def test_the_refusal_names_the_setting_to_change():
    for chosen_by, setting in [(BY_HOST, "replication_host"), (BY_ROUTE, "MLCHECKPOINT_REPLICATION_IFNAME"),
                               (BY_INTERFACE, "MLCHECKPOINT_REPLICATION_IFNAME")]:
        with pytest.raises(ConfigError) as ei:
            check_advertisable(Endpoint("127.0.0.1", "lo", chosen_by), 2, "10.213.250.1")
        assert setting in str(ei.value) and "MASTER_ADDR=10.213.250.1" in str(ei.value)
    check_advertisable(Endpoint("127.0.0.1", "lo", BY_HOST), 1, "10.213.250.1")
    check_advertisable(Endpoint("127.0.0.1", "lo", BY_HOST), 2, "127.0.0.1")


# --------------------------------------------------------------------------- the endpoint
def test_the_interface_wins_then_the_host_then_the_route():
    assert interface_ipv4("lo") == "127.0.0.1"
    assert choose_endpoint(host="localhost", interface="lo") == Endpoint("127.0.0.1", "lo", BY_INTERFACE)
    assert choose_endpoint(host="localhost") == Endpoint("127.0.0.1", "lo", BY_HOST)
    assert choose_endpoint(master_addr="127.0.0.1") == Endpoint("127.0.0.1", "lo", BY_ROUTE)


@pytest.mark.parametrize("name", ["nosuch0", "", "a" * 16, "../lo", "lo/x"])
def test_an_interface_that_is_not_there_is_a_config_error(name):
    with pytest.raises(ConfigError, match=f"MLCHECKPOINT_REPLICATION_IFNAME={name!r}"):
        interface_address(name, "MLCHECKPOINT_REPLICATION_IFNAME")


# --------------------------------------------------------------------------- a namespace of our own
@dataclass(frozen=True)
class Namespace:
    name: str
    interface: str  # carries ``address``
    address: str


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


@pytest.fixture
def netns() -> Iterator[Namespace]:
    """A network namespace with ``lo`` up and one interface holding 10.213.250.1/24: a dummy,
    or one end of a veth pair where the kernel has no dummy driver. Removed afterwards, with
    every process still in it, pass or fail."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create a network namespace")
    if shutil.which("ip") is None:
        pytest.skip("needs the ip command (iproute2)")
    ns = Namespace(f"mlck-{uuid.uuid4().hex[:8]}", "mlck0", "10.213.250.1")
    made = _ip("netns", "add", ns.name, check=False)
    if made.returncode != 0:
        pytest.skip(f"cannot create a network namespace: {made.stderr.strip()}")
    try:
        if _ip("-n", ns.name, "link", "add", ns.interface, "type", "dummy", check=False).returncode:
            _ip("-n", ns.name, "link", "add", ns.interface, "type", "veth", "peer", "name", "mlck1")
            _ip("-n", ns.name, "link", "set", "mlck1", "up")
        _ip("-n", ns.name, "addr", "add", f"{ns.address}/24", "dev", ns.interface)
        _ip("-n", ns.name, "link", "set", ns.interface, "up")
        _ip("-n", ns.name, "link", "set", "lo", "up")
        yield ns
    finally:
        pids = _ip("netns", "pids", ns.name, check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), 9)
            except (ProcessLookupError, ValueError):
                pass
        _ip("netns", "del", ns.name, check=False)


def run_job_in(ns: Namespace, cluster: Cluster, cfg: dict, timeout: float = 180) -> dict[int, dict]:
    """Two simulated nodes x 1 rank, both in ``ns``, MASTER_ADDR the namespace's address, each
    running tests/workers/iface_job.py with ``cfg``; returns each rank's report."""
    port = free_port()
    for node in cluster.nodes:
        env = {**os.environ, "MLCHECKPOINT_LOCAL_DIR": node.local_dir,
               "MLCHECKPOINT_JOB_ID": cluster.job_id, "TEST_OUT_DIR": cluster.out_dir,
               "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               "GLOO_SOCKET_IFNAME": ns.interface}  # gloo would resolve the host's name
        env.pop("MLCHECKPOINT_REPLICATION_IFNAME", None)
        env.pop("MLCHECKPOINT_REPLICATION_HOST", None)
        cmd = ["ip", "netns", "exec", ns.name, sys.executable, "-m", "torch.distributed.run",
               "--nnodes=2", f"--node-rank={node.rank}", "--nproc-per-node=1",
               f"--master-addr={ns.address}", f"--master-port={port}", "--max-restarts=0",
               os.path.join(WORKERS, "iface_job.py"), json.dumps(cfg)]
        with open(node.log_path, "a") as logf:
            node.proc = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT,
                                         start_new_session=True)
    codes = cluster.wait(timeout)  # a hang fails here (and everything is killed)
    assert codes == [0, 0], f"exit codes {codes}; logs:\n{cluster.logs()}"
    results = cluster.results("iface")
    assert sorted(results) == [0, 1], cluster.logs()
    return results


@pytest.mark.slow
def test_replication_listens_on_the_named_interface_and_refuses_loopback(netns):
    """replication_interface binds and advertises that NIC's address and replicates over it;
    a loopback replication_host beside a routable MASTER_ADDR is refused, naming it."""
    with Cluster(2) as c:
        # (a) replication_interface names the namespace's NIC: every rank binds and advertises
        # its address, step 0 is replicated over it, and node 0 logs where it listens and
        # where its partner said it listens.
        results = run_job_in(netns, c, {"kwargs": {"interface": netns.interface},
                                        "save": True})
        for rank, res in results.items():
            assert res["address"].rsplit(":", 1)[0] == netns.address, (rank, res)
            assert (res["interface"], res["chosen_by"]) == (netns.interface, BY_INTERFACE)
            assert res["protected"] is True
        logs = [node.log() for node in c.nodes]
        for k, log in enumerate(logs):  # once per node, by its local rank 0
            assert log.count(f"node {k} replicates over TCP: rank {k} listens on "
                             f"{results[k]['address']} ({netns.interface}") == 1, log
        assert f"reaches rank 1's replication listener at {results[1]['address']}" in logs[0]

        # (b) replication_host forced to loopback while MASTER_ADDR is the namespace's address:
        # every rank refuses at construction, naming the setting.
        c.clear_results()
        results = run_job_in(netns, c, {"kwargs": {"host": "127.0.0.1"}})
        for rank, res in results.items():
            assert "error" in res, (rank, res)
            assert "replication_host" in res["error"], res["error"]
            assert f"MASTER_ADDR={netns.address}" in res["error"], res["error"]

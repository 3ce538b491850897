"""The fork server and ``launch="fork"`` (mlcheckpoint/testing/forkserver.py, forked_rank.py): a
node started from already-imported modules must look, to the test's worker, like one started
as users type torchrun. Every test here starts processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
from cluster import Cluster, is_dead, process_tree
from helpers import wait_for

from mlcheckpoint.testing import forkserver

pytestmark = pytest.mark.slow

EXIT_HOW = ("0", "3", "raise", "sigterm", "segfault", "os._exit0", "os._exit3")


def probe(launch: str, how: str) -> tuple[dict[int, dict], list[int], str, list[str]]:
    with Cluster(1, 2, launch=launch) as c:
        c.start("launch_probe.py", "probe", how, env={"PROBE_ENV": f"{launch}-{how}"})
        codes = c.wait(60)
        torchrun_files = os.listdir(os.path.join(c.root, "torchelastic"))
        return c.results("probe"), codes, c.nodes[0].log(), torchrun_files


@pytest.fixture(scope="module")
def probes() -> dict[tuple[str, str], tuple[dict[int, dict], list[int], str, list[str]]]:
    return {(launch, how): probe(launch, how) for launch in ("exec", "fork") for how in EXIT_HOW}


def test_a_forked_rank_sees_what_an_execd_rank_sees(probes):
    """Signal handlers, parent-death signal, argv, import path, session, environment, working
    directory, a fresh logging setup and crash reports (the cluster sets
    ``PYTHONFAULTHANDLER``): the same under both launches."""
    for how in EXIT_HOW:
        execd, forked = probes[("exec", how)][0], probes[("fork", how)][0]
        assert sorted(execd) == sorted(forked) == [0, 1], (how, probes[("fork", how)][2])
        for rank in (0, 1):
            e, f = execd[rank], forked[rank]
            assert e.pop("env") == f"exec-{how}" and f.pop("env") == f"fork-{how}"
            assert e == f, (how, rank)
            assert f["pdeathsig"] == 0 and f["root_handlers"] == 1 and f["own_session"] is True
            assert f["faulthandler"] is True
            assert f["signals"]["SIGTERM"] == str(signal.SIG_DFL), f["signals"]
            assert f["argv"][0].endswith("/launch_probe.py") and f["argv"][1:] == ["probe", how]
            assert f["path0"] == os.path.dirname(f["argv"][0])


def test_a_forked_node_ends_as_an_execd_one(probes):
    """A clean exit, sys.exit(3), an exception, a rank killed by SIGTERM, a segfault and
    os._exit (0 and 3: torchrun waits for a forked rank's return value, not its exit) end the
    node the same way under both launches, and each rank's output reaches the node's log: a
    segfault's with the Python stack it happened in."""
    for how in EXIT_HOW:
        _, exec_codes, exec_log, _ = probes[("exec", how)]
        _, fork_codes, fork_log, _ = probes[("fork", how)]
        assert exec_codes == fork_codes, (how, exec_codes, fork_codes)
        assert (exec_codes == [0]) == (how in ("0", "os._exit0")), (how, exec_codes)
        for log in (exec_log, fork_log):
            assert log.count("probe-format probe logged at INFO") == 2, log
            assert ("RuntimeError: probe raised" in log) == (how == "raise")
            assert ("Fatal Python error: Segmentation fault" in log) == (how == "segfault"), log
            if how == "segfault":
                assert 'launch_probe.py", line' in log.split("Fatal Python error")[1], log


def test_torchrun_keeps_its_files_in_the_cluster_not_in_tmp(probes):
    """Each agent's per-run files (error files, its run's folder) go under the cluster's root,
    removed with it, not into a new /tmp/torchelastic_* that nothing removes."""
    for key, (_, _, _, torchrun_files) in probes.items():
        assert len(torchrun_files) == 1, (key, torchrun_files)  # the one agent's run


def orphan_the_ranks(c: Cluster, how: str) -> list[int]:
    """Start the probe (``how``) on node 0, wait until both ranks reported, SIGKILL the agent
    alone; return the ranks' pids."""
    c.start("launch_probe.py", "probe", how)
    wait_for(lambda: len(c.results("probe")) == 2, "both ranks report", timeout=60)
    agent = c.nodes[0].proc
    assert agent is not None
    ranks = process_tree(agent.pid)[1:]
    assert len(ranks) == 2, ranks
    os.kill(agent.pid, signal.SIGKILL)
    assert agent.wait(30) == -signal.SIGKILL
    return ranks


def test_closing_a_forked_cluster_kills_the_ranks_its_killed_agent_left():
    """An agent SIGKILLed alone leaves its forked ranks running (orphans whose environment, as
    /proc shows it, is the fork server's): closing the cluster still finds and kills them."""
    with Cluster(1, 2, launch="fork") as c:
        ranks = orphan_the_ranks(c, "sleep")
        assert not any(is_dead(p) for p in ranks)
        c.close()
        wait_for(lambda: all(is_dead(p) for p in ranks), "the orphaned ranks die", timeout=30)


def test_ranks_whose_agent_was_killed_end_when_their_script_does():
    """A forked rank hands its result to its agent at the end; with the agent SIGKILLed it ends
    instead, as an exec'd rank would, rather than wait for it forever."""
    with Cluster(1, 2, launch="fork") as c:
        ranks = orphan_the_ranks(c, "sleep2")
        wait_for(lambda: all(is_dead(p) for p in ranks), "the orphaned ranks end", timeout=30)


CHILD = """
import os, sys, time
print(os.getcwd(), os.environ.get("WHO"), os.getsid(0) == os.getpid(), sys.argv[1:], flush=True)
if sys.argv[1] == "sleep":
    time.sleep(120)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture
def child_script():
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "child.py")
        with open(path, "w") as f:
            f.write(CHILD)
        yield path


def test_the_server_reports_exits_timeouts_and_signals(child_script):
    """The Popen-like handle: exit codes (a signal as its negative), ``wait`` timing out,
    ``send_signal``; output written to the given descriptor, in the given directory and
    environment, in a session of its own."""
    d = os.path.dirname(child_script)
    server = forkserver.ForkServer(preload=("json",))
    try:
        log_path = os.path.join(d, "log")
        with open(log_path, "w") as log:
            done = server.spawn([sys.executable, child_script, "7"], env={"WHO": "child"},
                                stdout=log.fileno(), cwd=d)
            sleeper = server.spawn([sys.executable, child_script, "sleep"], env={"WHO": "sleeper"},
                                   stdout=log.fileno(), cwd=d)
        assert done.wait(30) == 7 and done.poll() == 7
        with pytest.raises(subprocess.TimeoutExpired):
            sleeper.wait(0.5)
        assert sleeper.poll() is None
        sleeper.send_signal(signal.SIGKILL)
        assert sleeper.wait(30) == -signal.SIGKILL
        with open(log_path) as f:
            lines = f.read().splitlines()
        assert f"{d} child True ['7']" in lines and f"{d} sleeper True ['sleep']" in lines, lines
    finally:
        server.close()


CLIENT = """
import sys, time
from mlcheckpoint.testing import forkserver
server = forkserver.ForkServer(preload=("json",))
p = server.spawn([sys.executable, sys.argv[1], "sleep"], env={}, stdout=sys.stderr.fileno())
print(server._proc.pid, p.pid, flush=True)
time.sleep(120)
"""


def test_a_server_whose_client_is_gone_kills_what_it_forked(child_script):
    """The server's client (the test run) ends: nothing it had forked is left running."""
    client = subprocess.Popen([sys.executable, "-c", CLIENT, child_script], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert client.stdout is not None
        server_pid, child_pid = map(int, client.stdout.readline().split())
        assert not is_dead(child_pid) and child_pid in process_tree(server_pid)
        client.kill()
        client.wait(30)
        deadline = time.monotonic() + 30
        while not (is_dead(child_pid) and is_dead(server_pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert is_dead(child_pid) and is_dead(server_pid)
    finally:
        client.kill()
        client.wait()


def test_the_server_refuses_a_malformed_request_and_serves_the_next(child_script):
    """A stranger's bytes on the socket (no descriptor, not JSON) and a command it cannot fork
    are refused with an error; the server goes on serving."""
    server = forkserver.ForkServer(preload=("json",))
    try:
        no_descriptor = json.dumps({"argv": [sys.executable, child_script, "0"]}).encode()
        for junk in (b"\x00garbage", no_descriptor):
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(server.path)
                s.sendall(junk)
                s.shutdown(socket.SHUT_WR)
                assert "error" in json.loads(s.makefile().readline())
        with open(os.devnull, "w") as null:
            with pytest.raises(RuntimeError, match="refused"):
                server.spawn([sys.executable, "-c", "pass"], env={}, stdout=null.fileno())
            p = server.spawn([sys.executable, child_script, "5"], env={}, stdout=null.fileno())
        assert p.wait(30) == 5
    finally:
        server.close()

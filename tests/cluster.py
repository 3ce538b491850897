"""Simulated multi-node jobs on one machine: one torchrun agent per node, own tmpfs dir each.

Losing a node = SIGKILL its agent's whole process group and delete its local_dir.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field

from typing_extensions import Self

HERE = os.path.dirname(os.path.abspath(__file__))
WORKERS = os.path.join(HERE, "workers")


def free_port() -> int:
    """A port for torchrun's rendezvous store, free now and likely still free when it binds.

    Taken below the kernel's ephemeral range: a port the kernel hands out (port 0) may be
    handed out again, to any connection or listener, before the agent binds it.
    """
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Node:
    rank: int
    local_dir: str
    proc: subprocess.Popen | None = None
    log_path: str = ""

    def kill(self) -> None:
        """SIGKILL every process of this node: the agent and its ranks (torchrun starts ranks in
        sessions of their own, so the agent's process group alone would miss them)."""
        lose_node(self)

    def wipe(self) -> None:
        """Lose the node's memory: what a replacement machine starts with."""
        shutil.rmtree(self.local_dir, ignore_errors=True)
        os.makedirs(self.local_dir, mode=0o700, exist_ok=True)

    def log(self) -> str:
        try:
            with open(self.log_path) as f:
                return f.read()
        except FileNotFoundError:
            return ""


@dataclass
class Cluster:
    """N simulated nodes x G ranks. Use as a context manager: everything is cleaned up."""

    nnodes: int
    nproc: int = 1
    job_id: str = field(default_factory=lambda: f"test-{uuid.uuid4().hex[:10]}")
    root: str = ""
    nodes: list[Node] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.root = tempfile.mkdtemp(prefix="mlckpt-test-", dir="/dev/shm")
        self.out_dir = os.path.join(self.root, "out")
        self.persistent_dir = os.path.join(self.root, "persistent")
        os.makedirs(self.out_dir)
        for k in range(self.nnodes):
            d = os.path.join(self.root, f"node{k}")
            os.makedirs(d, mode=0o700)
            self.nodes.append(Node(k, d, log_path=os.path.join(self.root, f"node{k}.log")))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.kill_all()
        kill_strays(self)
        shutil.rmtree(self.root, ignore_errors=True)

    def start(self, script: str, *args: str, nodes: list[int] | None = None, env: dict | None = None,
              nnodes: int | None = None) -> None:
        """Start torchrun agents for ``nodes`` (default all) running tests/workers/<script>."""
        nnodes = nnodes or self.nnodes
        port = free_port()
        for k in nodes if nodes is not None else range(nnodes):
            node = self.nodes[k]
            e = dict(os.environ)
            e.update({"MLCHECKPOINT_LOCAL_DIR": node.local_dir, "MLCHECKPOINT_JOB_ID": self.job_id,
                      "TEST_OUT_DIR": self.out_dir, "TEST_PERSISTENT_DIR": self.persistent_dir,
                      "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
            e.update(env or {})
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
                   f"--node-rank={k}", f"--nproc-per-node={self.nproc}",
                   "--master-addr=127.0.0.1", f"--master-port={port}", "--max-restarts=0",
                   os.path.join(WORKERS, script), *args]
            with open(node.log_path, "a") as logf:
                logf.write(f"\n===== {' '.join(cmd[3:])}\n")
                logf.flush()
                node.proc = subprocess.Popen(cmd, env=e, stdout=logf, stderr=subprocess.STDOUT,
                                             start_new_session=True)

    def wait(self, timeout: float = 120, nodes: list[int] | None = None) -> list[int]:
        """Wait for the nodes' agents; return exit codes. Kills everything on timeout."""
        deadline = time.time() + timeout
        codes = []
        for k in nodes if nodes is not None else range(len(self.nodes)):
            node = self.nodes[k]
            if node.proc is None:
                continue
            try:
                codes.append(node.proc.wait(timeout=max(0.1, deadline - time.time())))
            except subprocess.TimeoutExpired:
                self.kill_all()
                raise AssertionError(f"node {k} timed out; logs:\n{self.logs()}")
        return codes

    def run(self, script: str, *args: str, timeout: float = 120, **kw) -> None:
        """Start all nodes and require every one to exit 0."""
        self.start(script, *args, **kw)
        codes = self.wait(timeout)
        assert all(c == 0 for c in codes), f"exit codes {codes}; logs:\n{self.logs()}"

    def kill_all(self) -> None:
        for node in self.nodes:
            node.kill()

    def logs(self) -> str:
        return "\n".join(f"--- node {n.rank} ---\n{n.log()[-6000:]}" for n in self.nodes)

    def results(self, name: str) -> dict[int, dict]:
        """Per-rank JSON results written by workers with ``report(name, ...)``."""
        out = {}
        for fn in os.listdir(self.out_dir):
            if fn.startswith(name + ".rank") and fn.endswith(".json"):
                with open(os.path.join(self.out_dir, fn)) as f:
                    out[int(fn[len(name) + 5:-5])] = json.load(f)
        return out

    def clear_results(self, *names: str) -> None:
        """Forget earlier reports (all, or those ``names``), so a launch that reports nothing
        cannot pass on stale ones."""
        for fn in os.listdir(self.out_dir):
            if not names or any(fn.startswith(n + ".rank") for n in names):
                os.unlink(os.path.join(self.out_dir, fn))

    # Tests that run several jobs in one launch name each ``<cluster job id>-<name>``.
    def sub_job(self, name: str) -> str:
        return f"{self.job_id}-{name}"

    def sub_job_dir(self, node: int, name: str) -> str:
        return os.path.join(self.nodes[node].local_dir, self.sub_job(name))

    def sub_job_store(self, node: int, name: str):
        """That job's LocalStore on ``node`` (the caller closes it)."""
        from mlcheckpoint import LocalStore
        return LocalStore(self.nodes[node].local_dir, self.sub_job(name), create=False)

    def sub_job_results(self, kind: str, name: str) -> dict[int, dict]:
        return self.results(f"{kind}-{self.sub_job(name)}")


# --------------------------------------------------------------------------- whole-node kills
# torchrun starts every rank in a session of its own, so signalling the agent's process group
# (Node.kill) leaves the ranks running. These helpers reach the ranks too.

def _proc_states() -> dict[int, tuple[int, str]]:
    """pid -> (ppid, state) for every process visible in /proc."""
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out[int(name)] = (int(fields[1]), fields[0])
    return out


def _dead(pid: int) -> bool:
    state = _proc_states().get(pid)
    return state is None or state[1] in ("Z", "X")


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants, parents first."""
    children: dict[int, list[int]] = {}
    for p, (ppid, _) in _proc_states().items():
        children.setdefault(ppid, []).append(p)
    out, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def lose_node(node: Node, timeout: float = 30) -> list[int]:
    """A node dies at once: freeze the agent and every rank, then SIGKILL them all."""
    if node.proc is None or node.proc.poll() is not None:
        return []
    pids = process_tree(node.proc.pid)
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for p in pids:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
    node.proc.wait(timeout=timeout)
    deadline = time.time() + timeout
    while not all(_dead(p) for p in pids):
        if time.time() > deadline:
            raise AssertionError(f"processes {pids} survived SIGKILL")
        time.sleep(0.05)
    return pids


def kill_strays(cluster: Cluster) -> list[int]:
    """SIGKILL processes left over from ``cluster`` (ranks orphaned by a killed agent, DCP's
    checkpoint processes): those whose environment names this cluster's root directory."""
    marker = f"MLCHECKPOINT_LOCAL_DIR={cluster.root}/".encode()
    killed = []
    for pid in _proc_states():
        if pid == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if marker in env and not _dead(pid):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
    return killed

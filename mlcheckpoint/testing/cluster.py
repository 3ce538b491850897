"""Simulated multi-node jobs on one machine: the one way tests, benchmarks and the demo start nodes.

    with Cluster(nnodes=2, nproc=2) as c:          # two nodes of two ranks, on loopback
        c.start("tests/workers/x.py", "arg")       # one torchrun agent per node
        c.nodes[1].kill()                          # lose node 1: the agent and its ranks
        c.nodes[1].wipe()                          # and its memory (its local_dir)
        c.wait()
        c.results("x")                             # what the ranks wrote, per rank

A node is a torchrun agent with its own ``local_dir`` under /dev/shm (its "tmpfs"), its own log
and its environment: ``MLCHECKPOINT_LOCAL_DIR``, ``MLCHECKPOINT_JOB_ID``, and ``TEST_OUT_DIR``
/ ``TEST_PERSISTENT_DIR`` for workers' results and persistent checkpoints. All nodes of a
cluster share one root directory, removed with everything else on ``close()`` (or at the end
of a ``with`` block).

``SimulatedCluster`` holds what every kind of cluster shares (directories, starting agents,
waiting, results, logs); ``Cluster`` runs the nodes on loopback, and ``netcluster.NetCluster``
puts each in a network namespace of its own behind a shaped link.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from typing import Any

from typing_extensions import Self

from mlcheckpoint._faults import SIGKILLED_ITSELF
from mlcheckpoint.testing import forked_rank, forkserver
from mlcheckpoint.testing.forkserver import ForkedProcess


class NodeTimeout(TimeoutError, AssertionError):
    """A node's agent did not finish in time (an AssertionError too: in a test it is a
    failure, reported with the nodes' logs)."""


# --------------------------------------------------------------------------- ports and commands
def free_port() -> int:
    """A loopback port for a rendezvous store, free now and likely still free when it binds.

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


# How a cluster starts its nodes (``launch=``; MLCHECKPOINT_TEST_LAUNCH says, when not given):
#   "exec": each agent is ``python -m torch.distributed.run ... script``, each rank a fresh
#           ``python script`` it starts: torchrun as users type it;
#   "fork": each agent is forked from a server that imported torch, DCP and mlcheckpoint once
#           (``forkserver``), and torchrun forks the ranks from it (``--run-path
#           --start-method=fork``, its own option). The test suite's default: most of a
#           launch's CPU is importing (tests/README.md, Running).
LAUNCH_ENV = "MLCHECKPOINT_TEST_LAUNCH"
LAUNCHES = ("exec", "fork")
AgentProcess = subprocess.Popen | ForkedProcess


def torchrun_argv(script: str, args: Sequence[str], *, nnodes: int, node_rank: int, nproc: int,
                  master_addr: str, master_port: int, fork_ranks: bool = False,
                  log_dir: str | None = None) -> list[str]:
    """The command of one node's torchrun agent (static rendezvous, no restarts); with
    ``fork_ranks`` the agent forks its ranks, which run ``script`` in its interpreter as a
    fresh one would (``forked_rank``). ``log_dir``: where torchrun keeps its per-run files
    (its default is a new /tmp/torchelastic_* per agent, never removed)."""
    script = os.path.abspath(script)
    forked = ["--run-path", "--start-method=fork", forked_rank.__file__] if fork_ranks else []
    logs = [f"--log-dir={log_dir}"] if log_dir else []
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
            f"--node-rank={node_rank}", f"--nproc-per-node={nproc}",
            f"--master-addr={master_addr}", f"--master-port={master_port}", "--max-restarts=0",
            *logs, *forked, script, *args]


# --------------------------------------------------------------------------- processes
def _proc_states() -> dict[int, tuple[int, str]]:
    """pid -> (ppid, state) for every process visible in /proc."""
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            out[int(name)] = (int(fields[1]), fields[0])
    return out


def is_dead(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie counts as exited)."""
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


def signal_tree(proc: AgentProcess, sig: int) -> list[int]:
    """Send ``sig`` to ``proc`` and every descendant (torchrun starts each rank in a session of
    its own, so signalling the agent's process group would miss them); return the pids."""
    pids = process_tree(proc.pid)
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass
    return pids


def lose_node(node: Node, timeout: float = 30) -> list[int]:
    """A loopback node dies at once: freeze the agent and every rank, then SIGKILL them all;
    return their pids."""
    if node.proc is None or node.proc.poll() is not None:
        return []
    pids = process_tree(node.proc.pid)
    for sig in (signal.SIGSTOP, signal.SIGKILL):  # frozen first: none reacts to a sibling's death
        for p in pids:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
    node.proc.wait(timeout=timeout)
    deadline = time.monotonic() + timeout
    while not all(is_dead(p) for p in pids):
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {pids} survived SIGKILL")
        time.sleep(0.05)
    return pids


def _holds_open(pid: int, path: str) -> bool:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == path:
                return True
        except OSError:
            continue
    return False


def kill_strays(cluster: SimulatedCluster) -> list[int]:
    """SIGKILL processes left over from ``cluster`` (ranks orphaned by a killed agent, DCP's
    checkpoint processes): those whose environment names the cluster's root directory, or,
    forked ones (``launch="fork"``), that hold it open."""
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
        ours = marker in env or (cluster.launch == "fork" and _holds_open(pid, cluster.root))
        if ours and not is_dead(pid):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
    return killed


# --------------------------------------------------------------------------- nodes
class Node:
    """Node ``index`` of a simulated cluster: its local_dir, its log and its agent."""

    def __init__(self, index: int, local_dir: str, log_path: str):
        self.index, self.local_dir, self.log_path = index, local_dir, log_path
        self.proc: AgentProcess | None = None  # the torchrun agent of the last start()

    @property
    def rank(self) -> int:
        """The node rank torchrun gives it (its index)."""
        return self.index

    def kill(self) -> list[int]:
        """Lose the node: SIGKILL its agent and every rank; return the pids. The local_dir
        stays: ``wipe()`` loses that too."""
        return lose_node(self)

    def wipe(self) -> None:
        """Lose the node's memory: an empty local_dir, what a replacement machine starts with."""
        shutil.rmtree(self.local_dir, ignore_errors=True)
        os.makedirs(self.local_dir, mode=0o700, exist_ok=True)

    def log(self) -> str:
        """Everything this node's agents and ranks printed."""
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""


# --------------------------------------------------------------------------- clusters
class SimulatedCluster:
    """What every simulated cluster shares: ``nnodes`` nodes of ``nproc`` ranks under one root
    directory in /dev/shm, torchrun agents started and waited for, results and logs.

    Attributes: ``nodes``, ``root``, ``out_dir`` (workers' results), ``persistent_dir``,
    ``job_id``, ``nproc``, ``scripts_dir`` (where a relative script name is looked up; None:
    the working directory), ``launch`` (``LAUNCHES``). Subclasses say where nodes run
    (``_master_addr``, ``_spawn``).
    """

    def __init__(self, nnodes: int, nproc: int = 1, *, job_id: str | None = None,
                 prefix: str = "mlckpt-sim-", scripts_dir: str | None = None,
                 launch: str | None = None, node_class: type[Node] = Node, **node_kwargs: Any):
        self.launch = launch or os.environ.get(LAUNCH_ENV) or "exec"
        if self.launch not in LAUNCHES:
            raise ValueError(f"launch={self.launch!r}: one of {LAUNCHES}")
        self.nproc = nproc
        self.job_id = job_id or f"sim-{uuid.uuid4().hex[:10]}"
        self.scripts_dir = scripts_dir
        self.root = tempfile.mkdtemp(prefix=prefix, dir="/dev/shm")
        self.out_dir = os.path.join(self.root, "out")
        self.persistent_dir = os.path.join(self.root, "persistent")
        os.makedirs(self.out_dir)
        self.nodes: list[Node] = []
        for k in range(nnodes):
            node = node_class(k, os.path.join(self.root, f"node{k}"),
                              os.path.join(self.root, f"node{k}.log"), **node_kwargs)
            os.makedirs(node.local_dir, mode=0o700)
            self.nodes.append(node)

    @property
    def nnodes(self) -> int:
        return len(self.nodes)

    def node(self, k: int) -> Node:
        return self.nodes[k]

    # ------------------------------------------------------------------ starting and waiting
    def node_env(self, k: int) -> dict[str, str]:
        """The environment of node ``k``'s agents: ours, plus its local_dir and the job id, and
        the directories workers write results and persistent checkpoints to."""
        env = dict(os.environ)
        env.update({"MLCHECKPOINT_LOCAL_DIR": self.nodes[k].local_dir,
                    "MLCHECKPOINT_JOB_ID": self.job_id,
                    "TEST_OUT_DIR": self.out_dir, "TEST_PERSISTENT_DIR": self.persistent_dir,
                    "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                    # a crash in native code (a segfault) prints every thread's Python stack
                    "PYTHONFAULTHANDLER": "1"})
        return env

    def _master_addr(self) -> str:
        raise NotImplementedError

    def _master_port(self) -> int:
        raise NotImplementedError

    def _spawn(self, k: int, argv: list[str], env: dict[str, str], log: Any) -> AgentProcess:
        """Start node ``k``'s agent, ``argv``, writing to ``log``."""
        raise NotImplementedError

    def start(self, script: str, *args: str, nodes: Sequence[int] | None = None,
              env: dict[str, str] | None = None, nnodes: int | None = None) -> None:
        """Start a torchrun agent running ``script`` with ``args`` on each of ``nodes``
        (default: all), with static rendezvous at node 0. ``env`` adds to ``node_env``;
        ``nnodes`` (default: all) is the job's node count."""
        nnodes = nnodes or len(self.nodes)
        path = os.path.join(self.scripts_dir, script) if self.scripts_dir else script
        addr, port = self._master_addr(), self._master_port()
        fork_ranks = self.launch == "fork"
        for k in nodes if nodes is not None else range(nnodes):
            node = self.nodes[k]
            argv = torchrun_argv(path, args, nnodes=nnodes, node_rank=k, nproc=self.nproc,
                                 master_addr=addr, master_port=port, fork_ranks=fork_ranks,
                                 log_dir=os.path.join(self.root, "torchelastic"))
            with open(node.log_path, "a") as log:
                log.write(f"\n===== {' '.join(argv[3:])}\n")
                log.flush()
                node.proc = self._spawn(k, argv, {**self.node_env(k), **(env or {})}, log)

    def running(self) -> list[int]:
        """The nodes whose agent is still running."""
        return [n.index for n in self.nodes if n.proc is not None and n.proc.poll() is None]

    def wait(self, timeout: float = 120, nodes: Sequence[int] | None = None) -> list[int]:
        """Wait for the agents of ``nodes`` (default: all started); return their exit codes.
        On timeout every node is killed and NodeTimeout carries the logs."""
        deadline = time.monotonic() + timeout
        codes = []
        for k in nodes if nodes is not None else range(len(self.nodes)):
            proc = self.nodes[k].proc
            if proc is None:
                continue
            try:
                codes.append(proc.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                self.kill_all()
                raise NodeTimeout(f"node {k} timed out; logs:\n{self.logs()}") from None
        return codes

    def run(self, script: str, *args: str, timeout: float = 120, **kwargs: Any) -> None:
        """``start`` on all nodes and require every agent to exit 0 within ``timeout``."""
        self.start(script, *args, **kwargs)
        codes = self.wait(timeout)
        if any(codes):
            raise RuntimeError(f"exit codes {codes}; logs:\n{self.logs()}")

    def kill_all(self) -> None:
        """Lose every node's processes (their local_dirs stay)."""
        for node in self.nodes:
            node.kill()

    def logs(self) -> str:
        """The last lines of every node's log, for failure messages."""
        return "\n".join(f"--- node {n.index} ---\n{n.log()[-6000:]}" for n in self.nodes)

    # ------------------------------------------------------------------ results
    def results(self, name: str) -> dict[int, dict]:
        """Per-rank JSON results, ``<out_dir>/<name>.rank<r>.json`` (``write_result``)."""
        out = {}
        for fn in os.listdir(self.out_dir):
            if fn.startswith(name + ".rank") and fn.endswith(".json"):
                with open(os.path.join(self.out_dir, fn)) as f:
                    out[int(fn[len(name) + 5:-5])] = json.load(f)
        return out

    def clear_results(self, *names: str) -> None:
        """Forget earlier results (all, or those ``names``), so a launch that reports nothing
        cannot pass on stale ones."""
        for fn in os.listdir(self.out_dir):
            if not names or any(fn.startswith(n + ".rank") for n in names):
                os.unlink(os.path.join(self.out_dir, fn))

    # Several jobs in one launch name each ``<cluster job id>-<name>``.
    def sub_job(self, name: str) -> str:
        return f"{self.job_id}-{name}"

    def sub_job_dir(self, node: int, name: str) -> str:
        return os.path.join(self.nodes[node].local_dir, self.sub_job(name))

    def sub_job_store(self, node: int, name: str) -> Any:
        """That job's LocalStore on ``node`` (the caller closes it)."""
        from mlcheckpoint.store import LocalStore
        return LocalStore(self.nodes[node].local_dir, self.sub_job(name), create=False)

    def sub_job_results(self, kind: str, name: str) -> dict[int, dict]:
        return self.results(f"{kind}-{self.sub_job(name)}")

    # ------------------------------------------------------------------ cleanup
    def close(self) -> None:
        """Kill every process of the cluster and remove its directory."""
        self.kill_all()
        kill_strays(self)
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Cluster(SimulatedCluster):
    """``nnodes`` simulated nodes x ``nproc`` ranks on loopback (agents in sessions of their
    own, rendezvous on a free loopback port per start). Use as a context manager."""

    def __init__(self, nnodes: int, nproc: int = 1, *, job_id: str | None = None,
                 scripts_dir: str | None = None, prefix: str = "mlckpt-test-",
                 launch: str | None = None):
        super().__init__(nnodes, nproc, job_id=job_id or f"test-{uuid.uuid4().hex[:10]}",
                         prefix=prefix, scripts_dir=scripts_dir, launch=launch)

    def _master_addr(self) -> str:
        return "127.0.0.1"

    def _master_port(self) -> int:
        return free_port()

    def _spawn(self, k: int, argv: list[str], env: dict[str, str], log: Any) -> AgentProcess:
        if self.launch == "fork":
            return forkserver.shared().spawn(argv, env=env, stdout=log.fileno(),
                                             hold_open=self.root)
        return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


# --------------------------------------------------------------------------- a rank's SIGKILL
# A rank that SIGKILLs itself says so first: torchrun's forked ranks (launch="fork") report the
# first failure their agent sees, which may be another rank's error, so the exit code -9 need
# not reach the log. (The library's crash points, mlcheckpoint/_faults.py, say it the same way.)
def sigkill_self(why: str) -> None:
    """In a worker: write ``why`` and ``SIGKILLED_ITSELF`` to the node's log, then SIGKILL this
    process."""
    print(f"{why}: {SIGKILLED_ITSELF}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def died_of_sigkill(log: str) -> bool:
    """Whether a node's log shows a rank that died of SIGKILL: torchrun's exit code -9, or the
    rank's own word before it killed itself."""
    return re.search(r"exitcode\s*:\s*-9\b", log) is not None or SIGKILLED_ITSELF in log


# --------------------------------------------------------------------------- in a worker
def write_result(name: str, rank: int, value: Any, out_dir: str | None = None) -> str:
    """In a worker: write ``value`` as this rank's result ``name`` (read by ``results``);
    ``out_dir`` defaults to the cluster's, from ``TEST_OUT_DIR``. Returns the path."""
    out_dir = out_dir or os.environ["TEST_OUT_DIR"]
    path = os.path.join(out_dir, f"{name}.rank{rank}.json")
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)  # a reader never sees half a result
    return path

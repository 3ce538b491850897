"""An emulated cluster on one machine: N nodes in Linux network namespaces, one shaped link each.

    with NetCluster(nodes=2, nproc=2, rate="1gbit") as c:
        c.start("tests/workers/x.py", "arg")   # one torchrun agent per node, in its namespace
        c.node(1).kill()                        # lose node 1: every process in it, SIGKILLed
        c.node(1).wipe()                        # and its memory (its local_dir)
        c.wait()

Layout, for a cluster named ``mlckpt-net-<pid>-<n>``::

    namespace <name>-sw     bridge br0, ports p0 .. p<N-1>       (the "switch")
    namespace <name>-n<k>   lo, eth0 = 10.213.0.<k+1>/24         (node k)
    eth0 of node k and port p<k> are the two ends of one veth pair

Each link is shaped with a token bucket (tc tbf) twice: on eth0 (what node k sends) and on
p<k> (what node k receives). The host's own namespace gets no interface, address or route,
and the nodes have no default route: a process inside can reach only the other nodes (and
its own loopback), never the host or anything beyond it.

Directories, agents, results and logs are ``cluster.SimulatedCluster``'s (shared with the
loopback ``Cluster``); this module adds the namespaces and links (their rates: ``links.py``). Everything (processes,
namespaces and with them the veths, directories) is removed on ``close()``, at the end of a
``with`` block, at interpreter exit and on SIGTERM; ``clean_stale()`` removes what a crashed
earlier process left. Needs root and iproute2 (``ip``, ``tc``): see ``available()``.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .cluster import Node, SimulatedCluster, is_dead
from .links import parse_rate, tbf_params

PREFIX = "mlckpt-net-"
_OURS = re.compile(re.escape(PREFIX) + r"(\d+)-")  # names carry the creating process's pid
SUBNET = "10.213.0"  # private, and only ever assigned inside our own namespaces
IFACE = "eth0"  # every node's interface has this name (it lives in the node's own namespace)
_PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_tcp_peer.py")

_counter = itertools.count()
_live: set[NetCluster] = set()  # closed at exit and on SIGTERM
_hooks_installed = False


# --------------------------------------------------------------------------- small tools
def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    """Run an ``ip``/``tc`` command; on failure raise with its stderr (unless ``check=False``)."""
    res = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    if check and res.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({res.returncode}): {res.stderr.strip()}")
    return res


def _qdisc_bytes(netns: str, dev: str) -> int:
    """Bytes the root qdisc of ``dev`` in ``netns`` has passed so far."""
    out = _run(["tc", "-s", "-j", "-n", netns, "qdisc", "show", "dev", dev]).stdout
    return int(json.loads(out)[0]["bytes"])


def _netns_names() -> list[str]:
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).stdout.splitlines() if line]


def pids_in(netns: str) -> set[int]:
    """Pids of the live processes in network namespace ``netns`` (zombies have left it)."""
    try:
        target = os.stat(f"/run/netns/{netns}")
    except FileNotFoundError:
        return set()
    out = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                st = os.stat(f"/proc/{name}/ns/net")
            except OSError:
                continue
            if (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino):
                out.add(int(name))
    return out


def kill_netns(netns: str, timeout: float = 30) -> list[int]:
    """SIGKILL every process in ``netns``; return their pids. Each round freezes them all
    (SIGSTOP) before killing any, so none forks or reacts to a sibling's death in between;
    rounds repeat until the namespace is empty (a child forked meanwhile is caught next)."""
    seen: set[int] = set()
    deadline = time.monotonic() + timeout
    while pids := pids_in(netns):
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {sorted(pids)} in {netns} survived SIGKILL")
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        seen |= pids
        time.sleep(0.02)
    # A killed process leaves the namespace early in its exit, before it is a zombie: the
    # namespace can be empty while one is still exiting. Return only once every one is dead.
    while not all(is_dead(pid) for pid in seen):
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {sorted(p for p in seen if not is_dead(p))} in "
                               f"{netns} still exiting after SIGKILL")
        time.sleep(0.01)
    return sorted(seen)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def clean_stale() -> list[str]:
    """Remove what crashed earlier processes left behind: the namespaces (and the processes in
    them) and /dev/shm directories named ``mlckpt-net-<pid>-...`` whose pid is dead. Returns
    the names removed. Live processes' clusters are never touched."""
    removed = []
    for ns in _netns_names():
        m = _OURS.match(ns)
        if m and not _alive(int(m[1])):
            kill_netns(ns)
            _run(["ip", "netns", "del", ns], check=False)
            removed.append(ns)
    for name in os.listdir("/dev/shm"):
        m = _OURS.match(name)
        if m and not _alive(int(m[1])):
            shutil.rmtree(os.path.join("/dev/shm", name), ignore_errors=True)
            removed.append(name)
    return removed


@functools.lru_cache(maxsize=1)
def available() -> str | None:
    """None when this machine can run a NetCluster, else why not (for ``pytest.skip``).

    Tries what a cluster does, in a throwaway namespace: create it, run a process in it, make
    a veth pair and a bridge, and shape with tbf."""
    if not sys.platform.startswith("linux"):
        return "needs Linux network namespaces"
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth links and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs `{tool}` (iproute2) on PATH"
    if not os.path.isdir("/dev/shm"):
        return "needs /dev/shm (each node's local_dir)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    steps = [["ip", "netns", "add", probe],
             ["ip", "netns", "exec", probe, "true"],
             ["ip", "-n", probe, "link", "add", "name", "probe0", "type", "veth", "peer", "name", "probe1"],
             ["ip", "-n", probe, "link", "add", "name", "probebr", "type", "bridge"],
             ["tc", "-n", probe, "qdisc", "add", "dev", "probe0", "root", "tbf", "rate", "1gbit",
              "burst", "131072", "limit", "524288"]]
    try:
        for argv in steps:
            try:
                _run(argv)
            except (RuntimeError, OSError) as e:
                return f"cannot emulate a network here: {e}"
        return None
    finally:
        _run(["ip", "netns", "del", probe], check=False)


# --------------------------------------------------------------------------- cleanup hooks
def _close_all() -> None:
    for cluster in [c for c in _live if c._owner == os.getpid()]:
        try:
            cluster.close()
        except Exception as e:  # noqa: BLE001 (at exit or in a signal handler: report, go on)
            print(f"netcluster: cleanup failed: {e}", file=sys.stderr)


def _install_hooks() -> None:
    """Close every live cluster at exit and on SIGTERM (a killed test run must not leave its
    namespaces, and the torchrun agents run in sessions of their own, beyond its signal)."""
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    atexit.register(_close_all)
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread
    previous = signal.getsignal(signal.SIGTERM)
    if previous == signal.SIG_IGN:
        return

    def on_sigterm(signum: int, frame: Any) -> None:
        _close_all()
        if callable(previous):
            previous(signum, frame)
        else:  # die of SIGTERM, as without us
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)


# --------------------------------------------------------------------------- the cluster
@dataclass(frozen=True)
class RawTransfer:
    """One plain TCP transfer between two nodes (``NetCluster.raw_tcp_transfer``): what the
    link gives a single stream, and what moving the bytes cost each end's process (user +
    system CPU seconds, the kernel's network work inside their system calls included)."""

    nbytes: int
    seconds: float
    sender_cpu_s: float
    receiver_cpu_s: float

    @property
    def bytes_per_s(self) -> float:
        return self.nbytes / self.seconds


class NetNode(Node):
    """Node ``index`` of a NetCluster: a Node that lives in a network namespace, at ``address``."""

    def __init__(self, index: int, local_dir: str, log_path: str, *, cluster_name: str):
        super().__init__(index, local_dir, log_path)
        self.netns = f"{cluster_name}-n{index}"
        self.address = f"{SUBNET}.{index + 1}"
        self.port = f"p{index}"  # its switch port (in the switch namespace)

    def kill(self) -> list[int]:
        """Lose the node: SIGKILL every process in its namespace (the agent, its ranks, which
        torchrun starts in sessions of their own, and anything else run there); return the
        pids. The local_dir stays: ``wipe()`` loses that too."""
        pids = kill_netns(self.netns)
        if self.proc is not None:
            self.proc.wait()
        return pids

    def pids(self) -> set[int]:
        """The processes running in this node now."""
        return pids_in(self.netns)


class NetCluster(SimulatedCluster):
    """``nodes`` simulated nodes x ``nproc`` ranks, each node in a network namespace of its own
    behind a link shaped to ``rate`` ("1gbit", "500mbit", bits/s, or None: unshaped).

    Everything is set up by the constructor and removed by ``close()`` (or the end of a
    ``with`` block). Attributes: ``nodes`` (NetNode), ``root`` (its /dev/shm directory),
    ``out_dir`` (results of workers), ``persistent_dir``, ``job_id``, ``switch_netns``, ``rate``
    (bits/s or None).
    """

    def __init__(self, nodes: int, nproc: int = 1, rate: str | int | None = None,
                 job_id: str | None = None):
        if not 1 <= nodes <= 250:
            raise ValueError(f"nodes={nodes}: 1 to 250")
        parse_rate(rate)  # a bad rate fails here, before anything is made
        reason = available()
        if reason:
            raise RuntimeError(reason)
        clean_stale()
        _install_hooks()
        self.name = f"{PREFIX}{os.getpid()}-{next(_counter)}"
        self.switch_netns = f"{self.name}-sw"
        self.rate: int | None = None
        self._namespaces: list[str] = []  # created so far, for close()
        self._procs: list[subprocess.Popen] = []  # everything started, reaped by close()
        self._starts = 0
        self._closed = False
        self._owner = os.getpid()  # a forked child's exit must not tear down our cluster
        _live.add(self)
        try:
            super().__init__(nodes, nproc, job_id=job_id or f"net-{uuid.uuid4().hex[:10]}",
                             prefix=self.name + "-", node_class=NetNode, cluster_name=self.name)
            self.net_nodes: list[NetNode] = [n for n in self.nodes if isinstance(n, NetNode)]
            self._build()
            self.set_rate(rate)
        except BaseException:
            with contextlib.suppress(Exception):  # the first error is the one to see
                self.close()
            raise

    def _build(self) -> None:
        sw = self.switch_netns
        self._add_netns(sw)
        _run(["ip", "-n", sw, "link", "add", "name", "br0", "type", "bridge"])
        self._link_up(sw, "br0")
        for node in self.net_nodes:
            self._add_netns(node.netns)
            _run(["ip", "-n", node.netns, "link", "set", "lo", "up"])  # torch needs loopback
            # Made inside the switch namespace with its peer placed straight into the node's:
            # no end of it ever appears in the host's namespace.
            _run(["ip", "-n", sw, "link", "add", "name", node.port, "type", "veth",
                  "peer", "name", IFACE, "netns", node.netns])
            _run(["ip", "-n", sw, "link", "set", node.port, "master", "br0"])
            self._link_up(sw, node.port)
            _run(["ip", "-n", node.netns, "addr", "add", f"{node.address}/24", "dev", IFACE])
            self._link_up(node.netns, IFACE)

    def _add_netns(self, netns: str) -> None:
        _run(["ip", "netns", "add", netns])
        self._namespaces.append(netns)

    @staticmethod
    def _link_up(netns: str, dev: str) -> None:
        # No IPv6 link-local address, so no router solicitations or DAD chatter on the links.
        _run(["ip", "-n", netns, "link", "set", dev, "addrgenmode", "none"])
        _run(["ip", "-n", netns, "link", "set", dev, "up"])

    # ------------------------------------------------------------------ shaping
    def set_rate(self, rate: str | int | None) -> None:
        """Shape every node's link to ``rate`` in both directions (None: remove the shaping)."""
        bits = parse_rate(rate)
        for node in self.net_nodes:
            for netns, dev in ((node.netns, IFACE), (self.switch_netns, node.port)):
                if bits is None:  # veths default to no qdisc at all; deleting restores that
                    _run(["tc", "-n", netns, "qdisc", "del", "dev", dev, "root"], check=False)
                else:
                    burst, limit = tbf_params(bits)
                    _run(["tc", "-n", netns, "qdisc", "replace", "dev", dev, "root", "tbf",
                          "rate", f"{bits}bit", "burst", str(burst), "limit", str(limit)])
        self.rate = bits

    def link_bytes(self) -> dict[int, dict[str, int]]:
        """Per node, the bytes its link has carried so far: ``sent`` (counted by the tbf on
        its eth0) and ``received`` (by the tbf on its switch port). Needs a shaped link."""
        if self.rate is None:
            raise RuntimeError("link_bytes counts what the links' token buckets pass: set a rate")
        return {n.index: {"sent": _qdisc_bytes(n.netns, IFACE),
                          "received": _qdisc_bytes(self.switch_netns, n.port)}
                for n in self.net_nodes}

    # ------------------------------------------------------------------ nodes and processes
    def node(self, k: int) -> NetNode:
        return self.net_nodes[k]

    def address(self, k: int) -> str:
        """Node ``k``'s IPv4 address (on its eth0)."""
        return self.net_nodes[k].address

    def run_in(self, k: int, argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` as a plain process in node ``k``'s namespace (a session of its own);
        ``popen_kwargs`` go to subprocess.Popen. Losing the node or closing the cluster kills it."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.net_nodes[k].netns, *argv],
                                start_new_session=True, **popen_kwargs)
        self._procs = [p for p in self._procs if p.poll() is None] + [proc]
        return proc

    def node_env(self, k: int) -> dict[str, str]:
        """The environment of node ``k``'s agents (``SimulatedCluster.node_env``), with gloo
        bound to the node's interface."""
        # Left alone, gloo advertises what the host name resolves to: loopback on many
        # machines (this one too), useless to the other nodes.
        return {**super().node_env(k), "GLOO_SOCKET_IFNAME": IFACE}

    def _master_addr(self) -> str:
        return self.address(0)

    def _master_port(self) -> int:
        # Inside the namespaces nothing else listens, so any port is free; a new one per start
        # keeps a restarted job's store clear of the last one's lingering connections.
        self._starts += 1
        return 29500 + self._starts - 1

    def _spawn(self, k: int, argv: list[str], env: dict[str, str], log: Any) -> subprocess.Popen:
        return self.run_in(k, argv, env=env, stdout=log, stderr=subprocess.STDOUT)

    def logs(self) -> str:
        """The last lines of every node's log, for failure messages."""
        return "\n".join(f"--- node {n.index} ({n.address}) ---\n{n.log()[-6000:]}"
                         for n in self.net_nodes)

    # ------------------------------------------------------------------ a baseline
    def raw_tcp_transfer(self, src: int, dst: int, nbytes: int, into_tmpfs: bool = False,
                         timeout: float = 300) -> RawTransfer:
        """One plain TCP stream (sendfile) carrying ``nbytes`` from node ``src`` to node ``dst``,
        timed at the receiver: the link's own rate, and what moving the bytes costs the two
        processes' CPUs, for benchmarks to set replication against. With ``into_tmpfs`` the
        receiver lands the bytes in a fresh file in ``dst``'s local_dir, as a replica is."""
        into = [self.nodes[dst].local_dir, str(nbytes)] if into_tmpfs else []
        recv = self.run_in(dst, [sys.executable, "-I", _PEER, "recv", self.address(dst), *into],
                           stdout=subprocess.PIPE, text=True)
        send: subprocess.Popen | None = None
        try:
            assert recv.stdout is not None
            ready = recv.stdout.readline().split()  # "ready <port>"
            if ready[:1] != ["ready"]:
                raise RuntimeError(f"receiver in node {dst} did not start: {ready}")
            send = self.run_in(src, [sys.executable, "-I", _PEER, "send", self.address(dst),
                                     ready[1], str(nbytes)], stdout=subprocess.PIPE, text=True)
            sender_cpu = send.communicate(timeout=timeout)[0]
            if send.returncode:
                raise RuntimeError(f"sender in node {src} failed ({send.returncode})")
            got, seconds, receiver_cpu = recv.communicate(timeout=timeout)[0].split()
        finally:
            for p in (send, recv):
                if p is not None and p.poll() is None:
                    p.kill()
                    p.wait()
        if int(got) != nbytes:
            raise RuntimeError(f"sent {nbytes} bytes, received {got}")
        return RawTransfer(nbytes, float(seconds), float(sender_cpu), float(receiver_cpu))

    # ------------------------------------------------------------------ cleanup
    def close(self) -> None:
        """Kill every process in the cluster's namespaces, delete the namespaces (the veths
        and the bridge go with them) and the /dev/shm directory. Idempotent; raises at the end
        if something could not be removed."""
        if self._closed:
            return
        self._closed = True
        _live.discard(self)
        problems = []
        for ns in self._namespaces:
            try:
                kill_netns(ns)
            except RuntimeError as e:
                problems.append(str(e))
        for proc in self._procs:  # reap: they are our children
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                problems.append(f"pid {proc.pid} did not exit")
        for ns in reversed(self._namespaces):
            _run(["ip", "netns", "del", ns], check=False)
        left = [ns for ns in _netns_names() if ns.startswith(self.name + "-")]
        if left:
            problems.append(f"namespaces left: {left}")
        if getattr(self, "root", None):
            shutil.rmtree(self.root, ignore_errors=True)
        if problems:
            raise RuntimeError("netcluster cleanup: " + "; ".join(problems))

"""A simulated replication job for transport tests: TcpTransports joined through a TCPStore the
test process hosts, some in the test process, others in processes of their own
(tests/workers/repl_peer.py) so they can be SIGKILLed or SIGSTOPped. Plus raw-socket helpers
for talking to a listener the way a stranger or a broken peer would.

The fixtures ``make_job`` and ``tcp_warnings`` (conftest.py) build on this module.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import uuid
from dataclasses import asdict

import pytest
import torch.distributed as dist
from cluster import WORKERS
from helpers import WAIT, wait_for

from mlcheckpoint.integrity.checksum import checksum
from mlcheckpoint.replication import Rendezvous, Replicator
from mlcheckpoint.replication.schedule.rounds import Rounds
from mlcheckpoint.replication.tcp import protocol as p
from mlcheckpoint.replication.tcp.transport import TcpTransport
from mlcheckpoint.settings import ReplicationOptions, tuned
from mlcheckpoint.store import LocalStore, Manifest, ManifestItem, layout
from mlcheckpoint.topology import Topology

sys.path.insert(0, WORKERS)
from repl_peer import make_shard  # a worker module, found through WORKERS

TCP_LOGGER = "mlcheckpoint.replication.tcp"


def debris(store: LocalStore) -> list[str]:
    """Uncommitted files (in-flight writes) in any step directory of ``store``."""
    out = []
    for step in store.inventory.steps():
        with contextlib.suppress(FileNotFoundError):
            out += [n for n in os.listdir(store.paths.step_dir(step))
                    if n.endswith((layout.INFLIGHT, layout.TMP))]
    return out



class Job:
    """One simulated job: a TCPStore, per-rank node dirs, in-process and subprocess endpoints.

    ``close`` ends every process, listener and replicator it started (fixtures call it)."""

    def __init__(self, root: str, world: int):
        self.root, self.world = root, world
        self.job_id = f"faults-{uuid.uuid4().hex[:10]}"
        self.c10d = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
        self.secret = os.urandom(32)  # the launcher's secret: given to every endpoint, never stored
        self.status_dir = os.path.join(root, "status")
        os.makedirs(self.status_dir)
        self.transports: list[TcpTransport] = []
        self.replicators: list[Replicator] = []
        self.procs: list[subprocess.Popen] = []
        self._followers: list[tuple[threading.Event, threading.Thread]] = []

    def node_dir(self, rank: int) -> str:
        d = os.path.join(self.root, f"node{rank}")
        os.makedirs(d, mode=0o700, exist_ok=True)
        return d

    def store(self, rank: int) -> LocalStore:
        return LocalStore(self.node_dir(rank), self.job_id)

    def rdzv(self, rank: int) -> Rendezvous:
        return Rendezvous(self.c10d, self.job_id, rank, self.world, timeout=WAIT, secret=self.secret)

    def endpoint(self, rank: int, timeout: float = 60, cls=TcpTransport, *,
                 streams: int | None = None, bandwidth: int = 0,
                 min_stripe_bytes: int | None = None, **kw) -> TcpTransport:
        """An in-process endpoint on loopback (no budget unless ``bandwidth``); ``kw`` goes to
        the transport (e.g. ``max_connections``)."""
        options = ReplicationOptions(host="127.0.0.1", timeout=timeout, streams=streams,
                                     bandwidth=bandwidth)
        stripe = {} if min_stripe_bytes is None else {"min_stripe_bytes": min_stripe_bytes}
        with tuned(**stripe):
            t = cls(self.store(rank), self.rdzv(rank), options, **kw)
        self.transports.append(t)
        return t

    def idle_rank(self, rank: int) -> None:
        """Take part in replication rounds as ``rank``, a rank with nothing of its own to push:
        a replicator names the next round only once every rank of the job is done."""
        topology = Topology(rank=rank, world_size=self.world, local_rank=0, local_world_size=1,
                            node_rank=rank, num_nodes=self.world)
        rounds = Rounds(self.rdzv(rank), topology, self.store(rank).paths)
        stop = threading.Event()

        def follow() -> None:
            while not stop.wait(0.02):
                r = rounds.next()
                if r is not None:
                    rounds.finish(r, counted=False)

        thread = threading.Thread(target=follow, name=f"rounds-{rank}", daemon=True)
        thread.start()
        self._followers.append((stop, thread))

    def spawn(self, rank: int, cmd: str, env: dict | None = None, **cfg) -> subprocess.Popen:
        """An endpoint in a process of its own (tests/workers/repl_peer.py); ``cfg`` adds to
        (or overrides, e.g. ``dir``) its configuration."""
        config = {"host": "127.0.0.1", "port": self.c10d.port, "job": self.job_id, "rank": rank,
                  "world": self.world, "dir": self.node_dir(rank), "status_dir": self.status_dir,
                  "cmd": cmd, **cfg}
        e = dict(os.environ)
        e.pop("MLCHECKPOINT_CRASH_AT", None)
        e.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                  "MLCHECKPOINT_REPLICATION_SECRET": self.secret.hex(), **(env or {})})
        with open(self.log_path(rank), "a") as logf:
            proc = subprocess.Popen([sys.executable, os.path.join(WORKERS, "repl_peer.py"),
                                     json.dumps(config)], env=e, stdin=subprocess.PIPE,
                                    stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def log_path(self, rank: int) -> str:
        return os.path.join(self.root, f"peer{rank}.log")

    def logs(self) -> str:
        out = []
        for name in sorted(os.listdir(self.root)):
            if name.endswith(".log"):
                with open(os.path.join(self.root, name)) as f:
                    out.append(f"--- {name} ---\n{f.read()[-4000:]}")
        return "\n".join(out)

    def status(self, name: str, proc: subprocess.Popen | None = None) -> dict:
        """Wait for a status file written by a subprocess endpoint."""
        path = os.path.join(self.status_dir, name)

        def ready():
            if os.path.exists(path):
                return True
            if proc is not None and proc.poll() is not None:
                pytest.fail(f"peer exited with {proc.returncode} before writing {name}\n{self.logs()}")
            return False

        wait_for(ready, name, diag=self.logs)
        with open(path) as f:
            return json.load(f)

    def close(self) -> None:
        for stop, thread in self._followers:
            stop.set()
            thread.join(timeout=10)
        for r in self.replicators:
            r.close()
        for t in self.transports:
            t.close()
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                    os.kill(proc.pid, signal.SIGCONT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
            if proc.stdin is not None:
                proc.stdin.close()
        del self.c10d



def connect(t: TcpTransport) -> socket.socket:
    host, port = t.address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=WAIT)



def frames_to_eof(sock: socket.socket, on_ready=None) -> list[dict]:
    """Server replies until it closes; ``on_ready`` runs when it says "ready"."""
    frames = []
    while True:
        try:
            f = p.recv_frame(sock)
        except p.ProtocolError as e:
            assert "closed after 0 of" in str(e), f"server sent a broken frame: {e}"
            return frames
        except ConnectionResetError:
            return frames
        frames.append(f)
        if f.get("status") == "ready" and on_ready is not None:
            with contextlib.suppress(OSError):
                on_ready()


def half_close(sock: socket.socket) -> None:
    """We are done sending (the server may have hung up on us already)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)



def manifest_dict(job_id, step, owner, data_bytes=64, items=None) -> dict:
    m = Manifest(job_id=job_id, step=step, rank=owner, data_bytes=data_bytes,
                 items=items if items is not None else
                 [ManifestItem("w", 0, data_bytes, checksum(bytes(data_bytes)))])
    return asdict(m)


def assert_serves(job: Job, receiver: TcpTransport, sender: TcpTransport, step: int,
                  nbytes: int = 4096) -> None:
    """The listener still works: a legitimate push of a fresh shard lands, verified."""
    owner = sender.rdzv.rank
    m = make_shard(sender.store, step, owner, nbytes, seed=step)
    assert sender.push_shard(receiver.rdzv.rank, step, owner) == m.data_bytes
    got = receiver.store.verify_shard(step, owner)
    assert [i.checksum for i in got.items] == [i.checksum for i in m.items]



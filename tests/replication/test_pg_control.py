"""The pg transport's control channel costs the c10d store per node, not per rank, while the
job is idle (replication/pg/control.py, the doorbell), and still serves every rank's requests.

Two nodes of four ranks: eight processes (tests/workers/pg_node.py), each a real PgTransport
over a real gloo group and one real TCPStore, each counting its own store operations
(``testing.control.CountingStore``); a node's ranks share its job directory, as they do.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch.distributed as dist
from cluster import WORKERS
from helpers import end_peer, wait_for

from mlcheckpoint._messages import RateLimitedLog
from mlcheckpoint.replication import Rendezvous
from mlcheckpoint.replication.core.keys import Seal
from mlcheckpoint.replication.pg.control import Doorbell, Mailbox
from mlcheckpoint.replication.pg.transport import PgTransport
from mlcheckpoint.store.layout import JobPaths
from mlcheckpoint.topology import Topology

pytestmark = pytest.mark.timeout(300)
NODES, PER_NODE = 2, 4
WORLD = NODES * PER_NODE
NBYTES = 4096  # as the worker's shard


class PgJob:
    """The eight worker processes, and their answers."""

    def __init__(self, root: str):
        self.root = root
        self.c10d = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
        self.procs: list[subprocess.Popen] = []
        self.logs = [os.path.join(root, f"rank{r}.log") for r in range(WORLD)]
        self._ids = 0
        job, secret = f"pgctl-{secrets.token_hex(4)}", secrets.token_hex(32)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        for rank in range(WORLD):
            node_dir = os.path.join(root, f"node{rank // PER_NODE}")
            os.makedirs(node_dir, mode=0o700, exist_ok=True)
            cfg = {"host": "127.0.0.1", "port": self.c10d.port, "job": job, "dir": node_dir,
                   "rank": rank, "world": WORLD, "per_node": PER_NODE, "secret": secret,
                   "status_dir": root}
            with open(self.logs[rank], "w") as logf:
                self.procs.append(subprocess.Popen(
                    [sys.executable, os.path.join(WORKERS, "pg_node.py"), json.dumps(cfg)],
                    env=env, stdin=subprocess.PIPE, stdout=logf, stderr=subprocess.STDOUT,
                    start_new_session=True, text=True))

    def log(self) -> str:
        out = []
        for rank, path in enumerate(self.logs):
            with open(path) as f:
                out.append(f"--- rank {rank}\n{f.read()[-3000:]}")
        return "\n".join(out)

    def answer(self, what: str, rank: int, n: int) -> dict:
        path = os.path.join(self.root, f"{what}-{rank}-{n}")
        wait_for(lambda: os.path.exists(path) or self.procs[rank].poll() is not None,
                 f"{what} of rank {rank}", diag=self.log)
        assert self.procs[rank].poll() is None, self.log()
        with open(path) as f:
            return json.load(f)

    def ask(self, rank: int, cmd: dict) -> int:
        self._ids += 1
        self.procs[rank].stdin.write(json.dumps({**cmd, "id": self._ids}) + "\n")
        self.procs[rank].stdin.flush()
        return self._ids

    def ops(self) -> list[int]:
        """Every rank's store operations so far."""
        ids = [self.ask(rank, {"cmd": "count"}) for rank in range(WORLD)]
        return [self.answer("count", rank, n)["ops"] for rank, n in enumerate(ids)]

    def read(self, rank: int, peer: int) -> str:
        """Rank ``rank`` reads rank ``peer``'s shard from it: the sha256 of what came."""
        return self.answer("read", rank, self.ask(rank, {"cmd": "read", "peer": peer}))["sha256"]

    def close(self) -> None:
        for proc in self.procs:
            end_peer(proc)
        del self.c10d


@pytest.fixture
def pg_job(store_dir):
    job = PgJob(store_dir)
    try:
        for rank in range(WORLD):
            wait_for(lambda rank=rank: os.path.exists(os.path.join(store_dir, f"ready-{rank}"))
                     or job.procs[rank].poll() is not None, f"rank {rank} ready", diag=job.log)
        assert all(p.poll() is None for p in job.procs), job.log()
        yield job
    finally:
        job.close()


def shard_digest(owner: int) -> str:
    """The sha256 of the shard the worker of rank ``owner`` commits (repl_peer.make_shard)."""
    return hashlib.sha256(np.random.default_rng(owner).bytes(NBYTES)).hexdigest()


def idle_ops(job: PgJob) -> list[int]:
    """Each rank's store operations over an idle stretch."""
    before = job.ops()
    threading.Event().wait(1.0)  # an idle stretch to count over (nothing here is timed)
    return [b - a for a, b in zip(before, job.ops(), strict=True)]


def settle(job: PgJob, leaders: list[int], others: list[int], stretches: int = 10) -> None:
    """Wait until the looks the last rings owe are done: every non-leader of a rung node looks
    in its mailbox once (one store operation), whenever its thread next runs, which on a loaded
    machine may be after the request that rang was served by another rank of its node (CI saw
    [0, 0, 0, 1, 1, 0] in the stretch right after the reads). So: a stretch in which the
    others were quiet, after one in which every leader looked (its first look rings its node).
    A rank that looked on its own, unrung, would show in every stretch: ``stretches`` bounds
    the wait, and the caller's next stretch must still be quiet."""
    leaders_looked = False
    for _ in range(stretches):
        idle = idle_ops(job)
        if leaders_looked and not any(idle[r] for r in others):
            return
        leaders_looked = all(idle[r] > 0 for r in leaders)


@pytest.mark.slow
def test_an_idle_pg_job_costs_the_store_per_node_and_every_rank_is_served(pg_job):
    """Idle, a node's other ranks make no store operation (its leader watches the node's
    doorbell); a request to such a rank on the other node, from such a rank, is still served;
    and idle again afterwards they are quiet again."""
    leaders = [n * PER_NODE for n in range(NODES)]
    others = [r for r in range(WORLD) if r not in leaders]
    settle(pg_job, leaders, others)  # each rank looks in its mailbox once its leader first rang
    idle = idle_ops(pg_job)
    assert [idle[r] for r in others] == [0] * len(others), idle
    assert all(idle[r] > 0 for r in leaders), (idle, pg_job.log())  # the leaders look

    assert pg_job.read(1, 6) == shard_digest(6)  # node 0's rank 1 from node 1's rank 6
    assert pg_job.read(5, 2) == shard_digest(2)  # and back
    assert pg_job.read(0, 7) == shard_digest(7)  # a leader from another node's rank

    settle(pg_job, leaders, others)  # the reads rang both nodes: each of their other ranks looks once
    idle = idle_ops(pg_job)
    assert [idle[r] for r in others] == [0] * len(others), idle


@pytest.fixture
def c10d():
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    yield store
    del store


def test_a_ring_wakes_its_nodes_ranks_through_the_leader_alone(store_dir, c10d):
    """The doorbell, in one process (2 nodes x 2 ranks, one TCPStore): a request rings its
    rank's node only; the node's ranks learn of it from the node's file once the leader
    relayed it, once per count; a file not sealed by this run wakes nobody."""
    secret = secrets.token_bytes(32)

    def rdzv(rank: int) -> Rendezvous:
        return Rendezvous(c10d, "bell", rank, 4, timeout=60, secret=secret, session=b"this run")

    def place(rank: int) -> Topology:  # 2 nodes x 2 ranks, numbered node by node
        return Topology(rank=rank, world_size=4, local_rank=rank % 2, local_world_size=2,
                        node_rank=rank // 2, num_nodes=2)

    path = JobPaths(os.path.join(store_dir, "node0", "bell")).pg_bell
    leader_rdzv, other_rdzv = rdzv(0), rdzv(1)
    leader = Doorbell(leader_rdzv, Mailbox(leader_rdzv, "bell", 60, place(0)).seal, path, place(0))
    other = Doorbell(other_rdzv, Mailbox(other_rdzv, "bell", 60, place(1)).seal, path, place(1))
    assert leader.leader and not other.leader
    assert not other.rang()  # no file yet
    leader.relay()  # its first look: the count so far
    assert other.rang() and not other.rang()  # once per change

    poster = Mailbox(rdzv(2), "bell", 60, place(2))  # a rank of node 1
    poster.post(3, {"op": "get_metadata", "step": 1})  # for node 1: node 0 stays quiet
    leader.relay()
    assert not other.rang()
    poster.post(1, {"op": "get_metadata", "step": 1})  # for node 0
    assert not other.rang()  # not before the leader looked
    leader.relay()
    assert other.rang()

    stale = Seal(secret, b"an earlier run", leader_rdzv.prefix)  # what it left behind
    with open(path, "w") as f:
        f.write(stale.seal("node/0/pg-bell", {"count": 99}))
    assert not other.rang()


class FlakyStore:
    """A look at the store (the doorbell's ``relay``, the mailbox's ``take_request``) that
    fails its first ``failures`` times, as a store operation timing out on a loaded machine."""

    def __init__(self, failures: int):
        self.failures, self.calls = failures, 0

    def relay(self) -> None:
        self.calls += 1
        if self.calls <= self.failures:
            raise RuntimeError("store operation timed out")

    def take_request(self, seq: int) -> None:
        self.relay()

    def rang(self) -> bool:
        return True  # a request may wait: the mailbox is looked at


@pytest.mark.parametrize("loop", ["_relay_loop", "_serve_loop"])
def test_a_failed_look_at_the_store_is_retried_not_the_end_of_serving(monkeypatch, caplog, loop):
    """The leader's doorbell and every rank's mailbox go on after a store operation fails
    (said once, at WARNING) until ``close``. Before, the first failure ended the loop for good:
    the node's other ranks were never woken again, and requests to them went unanswered (CI
    saw a node's leader make no store operation at all)."""
    monkeypatch.setattr("mlcheckpoint.replication.pg.transport.STORE_RETRY_S", 0.01)
    flaky = FlakyStore(failures=3)
    transport = PgTransport.__new__(PgTransport)  # only what the loops read
    transport._closed, transport._poll = threading.Event(), 0.001
    transport.logs = RateLimitedLog(logging.getLogger("mlcheckpoint.replication.pg.transport"))
    transport.bell = transport.mailbox = flaky
    thread = threading.Thread(target=getattr(transport, loop), daemon=True)
    with caplog.at_level(logging.WARNING, logger="mlcheckpoint"):
        thread.start()
        wait_for(lambda: flaky.calls > 10, "the loop to look again after the failures")
        transport._closed.set()
        thread.join(timeout=10)
    assert not thread.is_alive()
    failed = [r for r in caplog.records if "failed: store operation timed out" in r.getMessage()]
    assert len(failed) == 1, [r.getMessage() for r in caplog.records]  # rate-limited

"""Replication rounds cost the c10d store per node, not per rank (replication/schedule/rounds.py).

Real replicators (threads of this process), real TCP transports and one real TCPStore; each
rank's store client counts what the library asks of it (``testing.control.CountingStore``).
Two nodes of four ranks share a job directory each, as a node's processes do.
"""

from __future__ import annotations

import os
import signal
import threading
import uuid

import pytest
import torch.distributed as dist
from helpers import WAIT, put_metadata, put_shard, wait_for
from tcp_job import make_shard

from mlcheckpoint.replication import Rendezvous, Replicator
from mlcheckpoint.replication.core.keys import Seal
from mlcheckpoint.replication.schedule.rounds import Rounds
from mlcheckpoint.replication.tcp.transport import TcpTransport
from mlcheckpoint.settings import ReplicationOptions
from mlcheckpoint.store import LocalStore
from mlcheckpoint.testing.control import CountingStore, OpCounts
from mlcheckpoint.topology import Topology

pytestmark = pytest.mark.timeout(300)
NODES, PER_NODE = 2, 4
WORLD = NODES * PER_NODE


def topology(rank: int, nodes: int = NODES, per_node: int = PER_NODE) -> Topology:
    return Topology(rank=rank, world_size=nodes * per_node, local_rank=rank % per_node,
                    local_world_size=per_node, node_rank=rank // per_node, num_nodes=nodes)


class GatedTcp(TcpTransport):
    """A real TcpTransport whose pushes wait for ``gate``: a rank stuck mid-round."""

    def __init__(self, *a, **kw):
        self.gate = threading.Event()
        self.gate.set()
        super().__init__(*a, **kw)

    def push_shard(self, peer: int, step: int, owner: int, items=None) -> int:
        self.gate.wait(WAIT)
        return super().push_shard(peer, step, owner, items)


class Job:
    """``NODES`` x ``PER_NODE`` ranks: a LocalStore, a transport and a replicator each, every
    rank's store operations counted in ``counts[rank]``."""

    def __init__(self, root: str):
        self.root = root
        self.job_id = f"rounds-{uuid.uuid4().hex[:8]}"
        self.c10d = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
        secret = os.urandom(32)
        self.counts = [OpCounts() for _ in range(WORLD)]
        self.stores, self.transports, self.replicators = [], [], []
        for rank in range(WORLD):
            rdzv = Rendezvous(CountingStore(self.c10d, self.counts[rank]), self.job_id, rank,
                              WORLD, timeout=WAIT, secret=secret, session=b"this run")
            store = LocalStore(self.node_dir(rank // PER_NODE), self.job_id)
            self.stores.append(store)
            self.transports.append(GatedTcp(store, rdzv, ReplicationOptions(
                host="127.0.0.1", timeout=WAIT, bandwidth=0)))
        for rank in range(WORLD):
            self.replicators.append(Replicator(self.stores[rank], self.transports[rank],
                                               self.transports[rank].rdzv, topology(rank),
                                               poll_interval=0.05))

    def node_dir(self, node: int) -> str:
        return os.path.join(self.root, f"node{node}")

    def save(self, step: int) -> None:
        """Every rank commits its shard of ``step`` (and each node the metadata), then tells
        its replicator, as the Saver's publish does."""
        for rank in range(WORLD):
            put_shard(self.stores[rank], step, rank)
        for node in range(NODES):
            put_metadata(self.stores[node * PER_NODE], step, ranks=tuple(range(WORLD)))
        for rep in self.replicators:
            rep.notify(step, "")

    def ops(self) -> list[int]:
        return [c.total() for c in self.counts]

    def close(self) -> None:
        for t in self.transports:
            t.gate.set()
        for r in self.replicators:
            r.close()
        for t in self.transports:
            t.close()
        for s in self.stores:
            s.close()
        del self.c10d


@pytest.fixture
def job(store_dir):
    j = Job(store_dir)
    try:
        yield j
    finally:
        j.close()


def leaders() -> list[int]:
    return [n * PER_NODE for n in range(NODES)]


def others() -> list[int]:
    return [r for r in range(WORLD) if r % PER_NODE]


def test_only_node_leaders_talk_to_the_store_per_round_and_when_idle(job):
    """The first round connects (listener addresses); from the second on, a node's other
    ranks make no store operation at all, neither in a round, nor waiting for protection,
    nor asking for it, nor idle; each leader makes a handful per round besides its looks."""
    job.save(1)
    for rep in job.replicators:
        assert rep.wait_replicated(1, WAIT)
    before = job.ops()
    reads_before = [c.snapshot() for c in job.counts]
    job.save(2)
    for rep in job.replicators:
        assert rep.wait_replicated(2, WAIT)
        assert rep.protection().newest_protected == 2
    after = job.ops()
    for rank in others():
        assert after[rank] == before[rank], (rank, job.counts[rank].snapshot())
    for rank in leaders():
        now, then = job.counts[rank].snapshot(), reads_before[rank]
        # name or read the round, count the node's shards, count the node done, read the
        # verdict; the leader that completes the round seals it (two counters, one set);
        # rank 0 also counts the metadata it pushed. Looks ("check") come on top.
        spent = {op: now.get(op, 0) - then.get(op, 0) for op in ("set", "get", "add")}
        assert 0 < sum(spent.values()) <= 8, (rank, spent)
        assert now.get("wait", 0) == then.get("wait", 0), (rank, now)

    # Idle: a round is closed everywhere; the other ranks look only at their node's file.
    wait_for(lambda: all(r.rounds.all_done(2) for r in job.replicators), "round 2 closed everywhere")
    idle = job.ops()
    stop = threading.Event()
    stop.wait(1.0)  # an idle stretch to count over (nothing here is timed)
    for rep in job.replicators:
        rep.protection()  # what a training loop logs: no store operation either
    end = job.ops()
    assert [end[r] - idle[r] for r in others()] == [0] * len(others())


def test_a_stuck_leader_holds_no_other_rank_of_its_node(job):
    """Node 1's leader is stuck in its push (a frozen or dying process): its other ranks still
    finish the round, and every wait of theirs ends at its timeout; none hangs."""
    job.save(1)
    for rep in job.replicators:
        assert rep.wait_replicated(1, WAIT)
    stuck = PER_NODE  # node 1's leader
    job.transports[stuck].gate.clear()
    job.save(2)
    for rank in range(PER_NODE + 1, WORLD):
        wait_for(lambda rank=rank: (st := job.replicators[rank].state(2)) is not None
                 and st.state == "replicated", f"rank {rank} to push step 2")
    follower = job.replicators[PER_NODE + 1]
    wait_for(lambda: follower.rounds.finished == 2, "the other ranks of node 1 to finish round 2")
    assert not follower.wait_replicated(2, timeout=0.5)  # never reported by its node: not protected
    follower.drain(timeout=0.5)
    follower.close()  # its thread is joined: it waits for nothing of the leader's
    assert not follower._thread.is_alive()
    assert follower.rounds.next() is None  # no next round, and no wait for one
    assert not job.replicators[0].rounds.all_done(2)  # the job is held, as by any dead rank


@pytest.mark.slow
def test_a_leader_killed_mid_round_holds_no_other_rank_of_its_node(make_job):
    """2 nodes x 2 ranks; node 1's leader (rank 2) is a process of its own, SIGKILLed while it
    pushes its shard of step 2, after it told its node of round 2. Rank 3, on its node, finishes
    the round, and every wait of its ends at its timeout: none waits for the dead leader."""
    job = make_job(4)
    dirs = [job.node_dir(0), job.node_dir(2)]  # node 0's and node 1's local_dir
    in_process = {0: dirs[0], 1: dirs[0], 3: dirs[1]}
    reps: dict[int, Replicator] = {}
    for rank, d in in_process.items():
        t = TcpTransport(LocalStore(d, job.job_id), job.rdzv(rank),
                         ReplicationOptions(host="127.0.0.1", timeout=WAIT, bandwidth=0))
        job.transports.append(t)
        reps[rank] = Replicator(t.store, t, t.rdzv, topology(rank, nodes=2, per_node=2),
                                poll_interval=0.05)
        job.replicators.append(reps[rank])
    try:
        _kill_the_leader_mid_round(job, dirs, reps)
    finally:
        for rep in reps.values():
            rep.close()
            rep.transport.close()
            rep.store.close()


def _kill_the_leader_mid_round(job, dirs: list[str], reps: dict[int, Replicator]) -> None:
    leader = job.spawn(2, "replicate", dir=dirs[1], nodes=2, per_node=2, nbytes=1 << 16,
                       env={"MLCHECKPOINT_CRASH_AT": "replica_mid_send@2#2"})
    job.status("2.ready", leader)

    def save(step: int) -> None:
        # The leader's shard first: rank 0 names the round once node 0 holds the metadata.
        leader.stdin.write(f"{step}\n".encode())
        leader.stdin.flush()
        job.status(f"2.saved-{step}", leader)
        for rank, rep in reps.items():
            m = make_shard(rep.store, step, rank, 1 << 16)
            rep.store.metadata.write(step, b"meta", world_size=4, ranks=range(4),
                                     total_bytes=1 << 18, save_id=m.save_id)
            rep.notify(step, m.save_id)

    save(1)
    for rep in reps.values():
        assert rep.wait_replicated(1, WAIT), job.logs()
    save(2)
    assert leader.wait(WAIT) == -signal.SIGKILL, job.logs()  # died mid-push, at the crash point
    follower = reps[3]
    wait_for(lambda: follower.rounds.finished == 2, "rank 3 to finish round 2", diag=job.logs)
    assert not follower.wait_replicated(2, timeout=0.5)
    assert not reps[0].wait_replicated(2, timeout=0.5)
    follower.drain(timeout=0.5)
    follower.close()
    assert not follower._thread.is_alive()
    assert not reps[0].rounds.all_done(2)  # node 1 never reported: the job is held, not a rank


@pytest.fixture
def c10d():
    server = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    try:
        yield server
    finally:
        del server


def test_node_files_are_sealed_for_this_run_and_written_whole(store_dir, c10d):
    """A node's round file or a rank's report not sealed by this run (left by an earlier run,
    or written by anyone else) is ignored; the files are 0600 in the 0700 job directory and
    replaced by a rename, never written in place."""
    secret, job_id = os.urandom(32), "sealed"
    store = LocalStore(store_dir, job_id)

    def rounds(rank: int, session: bytes = b"this run") -> Rounds:
        rdzv = Rendezvous(c10d, job_id, rank, 2, secret=secret, session=session)
        return Rounds(rdzv, topology(rank, nodes=1, per_node=2), store.paths)

    try:
        leader, follower = rounds(0), rounds(1)
        old = Seal(secret, b"an earlier run", leader.rdzv.prefix)
        for path, key, msg in ((store.paths.round, "node/0/round",
                                {"latest": [1, 7, "forged"], "closed": 0, "protected": [1, 7, "forged"]}),
                               (store.paths.round_done(1), "node/0/round-done/1", {"round": 1, "counted": 1})):
            with open(path, "w") as f:
                f.write(old.seal(key, msg))
        assert follower.next() is None and follower.protected is None

        r = leader.propose(1, 3, "save-3")
        assert leader.next() == r
        leader.finish(r, counted=True)
        assert not leader.all_done(1)  # the forged report of rank 1 did not count
        assert follower.next() == r  # the leader's file replaced the forged one
        follower.finish(r, counted=True)
        wait_for(lambda: leader.next() is None and leader.all_done(1), "round 1 closed")
        for path in (store.paths.round, store.paths.round_done(1)):
            assert os.stat(path).st_mode & 0o777 == 0o600
        assert os.stat(store.job_dir).st_mode & 0o077 == 0
        assert sorted(os.listdir(os.path.dirname(store.paths.round))) == ["round", "round-00001"]

        with open(store.paths.round, "wb") as f:  # garbage in the leader's place
            f.write(b"\x00" * 10)
        stale = follower.latest
        assert follower.next() is None and follower.latest == stale
    finally:
        store.close()

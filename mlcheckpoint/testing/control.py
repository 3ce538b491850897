"""The replication control plane, counted: a c10d store client that counts the operations the
library makes through it, and many simulated ranks (threads) that speak the real round
protocol (``replication/schedule/rounds.py``, over ``Rendezvous``) to one real TCPStore. Used by
``tests/replication/test_rounds_control.py`` and ``benchmarks/bench_control.py``.
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ..replication.core.rendezvous import Rendezvous
from ..replication.schedule.rounds import Rounds
from ..store.layout import JobPaths
from ..topology import Topology

OPS = ("set", "get", "add", "check", "wait", "compare_set")


class OpCounts:
    """Store operations by kind, from any number of threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._n: collections.Counter[str] = collections.Counter()

    def count(self, op: str) -> None:
        with self._lock:
            self._n[op] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._n)

    def total(self) -> int:
        with self._lock:
            return sum(self._n.values())


class CountingStore(dist.Store):
    """A c10d store client that counts each operation, then makes it on ``inner``. ``clone``
    (what ``Rendezvous`` does for each thread) clones ``inner`` and counts into the same
    ``counts``. Every clone stays referenced here: c10d keeps only the C++ half of a Python
    store alive, and the Python half is what counts."""

    def __init__(self, inner: dist.Store, counts: OpCounts | None = None):
        super().__init__()
        self.inner, self.counts = inner, counts if counts is not None else OpCounts()
        self._clones: list[CountingStore] = []

    def clone(self) -> CountingStore:
        c = CountingStore(self.inner.clone(), self.counts)  # type: ignore[attr-defined]
        self._clones.append(c)
        return c

    def set(self, key: str, value: Any) -> None:
        self.counts.count("set")
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        self.counts.count("get")
        return self.inner.get(key)

    def add(self, key: str, amount: int) -> int:
        self.counts.count("add")
        return self.inner.add(key, amount)

    def check(self, keys: list[str]) -> bool:
        self.counts.count("check")
        return self.inner.check(keys)

    def wait(self, keys: list[str], *timeout: Any) -> None:
        self.counts.count("wait")
        self.inner.wait(keys, *timeout)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        self.counts.count("compare_set")
        return self.inner.compare_set(key, expected, desired)


class SimulatedRanks:
    """``nodes`` x ``per_node`` ranks as threads, each with its own store client (counting into
    its own ``OpCounts``), ``Rendezvous`` and round protocol (``make_rounds``; default the
    library's ``Rounds``), each node's ranks sharing a job directory under ``root``.

    Each thread runs the replicator's loop (``Replicator._run``) with a push that takes no
    time: wait for a wake or ``rounds.wait_s(poll)``, take the round, report it done. Rank 0
    also counts the metadata as pushed (as the replicator does) and names round k when
    ``save(k)`` was called and the last round is all done; ``proposed[k]`` is set then.
    """

    def __init__(self, store: dist.Store, root: str, nodes: int, per_node: int, *,
                 secret: bytes, job_id: str = "control", poll: float = 0.1,
                 make_rounds: Callable[[Rendezvous, Topology, JobPaths], Any] = Rounds):
        self.nodes, self.per_node, self.poll = nodes, per_node, poll
        self.world = nodes * per_node
        self.counts = [OpCounts() for _ in range(self.world)]
        self.proposed: dict[int, threading.Event] = collections.defaultdict(threading.Event)
        self.errors: list[BaseException] = []
        self._pending: int | None = None
        self._stop = threading.Event()
        self._wakes = [threading.Event() for _ in range(self.world)]
        self.rounds: list[Any] = []
        for rank in range(self.world):
            node, local = divmod(rank, per_node)
            topology = Topology(rank=rank, world_size=self.world, local_rank=local,
                                local_world_size=per_node, node_rank=node, num_nodes=nodes)
            rdzv = Rendezvous(CountingStore(store, self.counts[rank]), job_id, rank, self.world,
                              secret=secret, session=b"simulated-run")
            paths = JobPaths(os.path.join(root, f"node{node}", job_id))
            self.rounds.append(make_rounds(rdzv, topology, paths))
        self._threads = [threading.Thread(target=self._run, args=(rank,), name=f"rank-{rank}",
                                          daemon=True) for rank in range(self.world)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def save(self, step: int) -> None:
        """Every rank committed save ``step``: rank 0 names it once the last round is done."""
        self._pending = step
        for rounds, wake in zip(self.rounds, self._wakes, strict=True):
            rounds.hurry()
            wake.set()

    def ops(self, ranks: list[int] | None = None) -> int:
        return sum(self.counts[r].total() for r in (range(self.world) if ranks is None else ranks))

    def leaders(self) -> list[int]:
        return [n * self.per_node for n in range(self.nodes)]

    def followers(self) -> list[int]:
        return [r for r in range(self.world) if r % self.per_node]

    def close(self) -> None:
        self._stop.set()
        for w in self._wakes:
            w.set()
        for t in self._threads:
            t.join(timeout=30)

    def _run(self, rank: int) -> None:
        rounds, wake = self.rounds[rank], self._wakes[rank]
        try:
            while not self._stop.is_set():
                wake.wait(rounds.wait_s(self.poll))
                wake.clear()
                r = rounds.next()
                if r is not None:
                    if rank == 0:
                        rdzv = rounds.rdzv
                        rdzv.add(rdzv.counter("meta", r.step, r.save_id), 1)
                    rounds.finish(r, counted=True)
                    wake.set()
                elif rank == 0 and (step := self._pending) is not None \
                        and rounds.all_done(rounds.finished):
                    self._pending = None
                    number = rounds.finished + 1
                    rounds.propose(number, step, f"save-{step}")
                    self.proposed[number].set()
                    wake.set()
        except BaseException as e:  # noqa: BLE001 (the test or benchmark reports it)
            self.errors.append(e)

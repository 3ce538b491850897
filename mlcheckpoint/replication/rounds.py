"""Replication rounds: which save every rank of the job replicates next, agreed job-wide.

When the link cannot carry every checkpoint, replication must skip steps. If each rank skipped
to its own newest step, ranks would skip different steps, and the replicas a node keeps for its
partner would rarely add up to one whole step: a step is only worth keeping twice when *every*
rank's shard of it is on two nodes. So the job replicates in rounds:

1. rank 0 names round g: one save (step, save id), the newest one whose metadata it holds;
2. every rank pushes its shard of that save (rank 0 also the metadata), then reports done;
3. once every rank has reported round g, rank 0 names round g + 1. Saves made in between were
   never named: they are *superseded* (``wait_replicated`` on them returns False at once).

A round that left its save unprotected (a partner was down, a replaced node had not rebuilt
its own shard yet) is named again after a back-off, unless a newer save exists by then.

Rounds live in the job's c10d store under HMAC-named keys, and each round is sealed with the
job's secret (``control.Seal``): a stranger who can reach the store can neither find the keys
nor steer replication with a forged round.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from . import protocol as p
from .control import Seal
from .rendezvous import Rendezvous

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Round:
    """Round ``number`` replicates the save ``save_id`` of ``step``."""

    number: int
    step: int
    save_id: str


class Rounds:
    """One rank's view of the job's replication rounds (see the module docstring).

    Only rank 0 calls ``propose``; every rank calls ``next`` and ``finish``.
    """

    def __init__(self, rdzv: Rendezvous, world_size: int):
        self.rdzv, self.world_size = rdzv, world_size
        self._seal = Seal(rdzv.secret(), rdzv.session, rdzv.prefix)
        self.finished = 0  # the last round this rank reported done
        self.latest: Round | None = None  # the newest round this rank has seen

    def _key(self, number: int) -> str:
        return self.rdzv.counter("round", number)

    def next(self) -> Round | None:
        """The round after the last one this rank finished, if it is named yet (one store look:
        the replicator polls; a blocking wait would log a c10d warning at every timeout)."""
        key = self._key(self.finished + 1)
        store = self.rdzv.store
        if not store.check([key]):
            return None
        msg = self._seal.open(key, store.get(key))
        step, save_id = msg.get("step"), msg.get("save_id")
        if not isinstance(step, int) or not isinstance(save_id, str):
            raise p.ProtocolError(f"replication round {self.finished + 1} is malformed: {msg}")
        r = Round(self.finished + 1, step, save_id)
        self.latest = r
        return r

    def finish(self, r: Round) -> None:
        """This rank is done with round ``r`` (pushed, or gave up). The last rank to finish
        says so under a key of its own: one look tells rank 0."""
        if self.rdzv.add(self.rdzv.counter("round-done", r.number), 1) >= self.world_size:
            self.rdzv.store.set(self.rdzv.counter("round-all-done", r.number), "1")
        self.finished = r.number

    def all_done(self, number: int) -> bool:
        """Every rank finished round ``number`` (round 0 is the start: always done)."""
        if number == 0:
            return True
        return bool(self.rdzv.store.check([self.rdzv.counter("round-all-done", number)]))

    def propose(self, number: int, step: int, save_id: str) -> Round:
        """Name round ``number`` (rank 0 only, once the previous round is all done)."""
        key = self._key(number)
        self.rdzv.store.set(key, self._seal.seal(key, {"step": step, "save_id": save_id}))
        log.debug("replication round %d: step %d (save %s)", number, step, save_id)
        return Round(number, step, save_id)

"""Recovery orchestration for one rank: inventory -> plan -> fetch -> verify -> load -> heal.

Every rank runs the same pure planner on the same gathered inventories, so they agree on
the step; each fetch and verification problem is gathered too, and the planner runs again
without the bad copies, so all ranks move to the next candidate together.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..dcp import MemoryStorageReader
from ..errors import CorruptShardError, MLCheckpointError, ShardNotFoundError
from ..store import LocalStore
from ..store.identity import Lineage
from ..topology import Topology
from .inventory import take_inventory
from .planner import FRESH, MEMORY, PERSISTENT, BadCopy, Decision, plan_resume

log = logging.getLogger(__name__)
MAX_ROUNDS = 16


@dataclass
class ResumeInfo:
    """What ``resume`` loaded: ``step`` is None (and ``source`` None) for a fresh start."""

    step: int | None
    source: str | None  # "local", "peer", "persistent" or None
    seconds: float
    sources: dict[int, str] = field(default_factory=dict)  # rank -> where its bytes came from
    bytes_fetched: int = 0  # job-wide, from peers
    reason: str | None = None  # why newer candidates were refused, if any


@dataclass
class Comm:
    """The collectives recovery needs (on the checkpoint group, never the training group)."""

    all_gather: Callable[[Any], list[Any]]


class Recovery:
    """One rank's part of a resume. ``transport`` is None when replication is off."""

    def __init__(self, store: LocalStore, topology: Topology, comm: Comm, *, transport=None,
                 persistent=None, load: Callable[[dict, Any], None], lineage: Lineage):
        self.store, self.topo, self.comm = store, topology, comm
        self.transport, self.persistent, self.load = transport, persistent, load
        self.lineage = lineage  # this run's; after ``run``, extended by what it loaded
        self.bytes_fetched = 0
        self.decision: Decision | None = None

    def run(self, state_dict: dict) -> ResumeInfo:
        t0 = time.perf_counter()
        self.phases: dict[str, float] = {}
        self.store.gc(ranks=[self.topo.rank])  # what a crash of this rank left behind
        nodes, persistent_step = self._gather_inventory()
        self._lap("inventory", t0)
        bad: set[BadCopy] = set()
        bad_steps: set[int] = set()
        notes: list[str] = []
        for _ in range(MAX_ROUNDS):
            d = plan_resume(nodes, persistent_step, self.topo.world_size, bad_copies=bad,
                            bad_steps=bad_steps, can_fetch=self.transport is not None)
            self.decision = d
            if d.kind != MEMORY:
                break
            t = time.perf_counter()
            problems = self._gather_problems(self._fetch(d))
            if not problems:
                problems = self._gather_problems(self._verify(d))
            self._lap("fetch+verify", t)
            if problems:
                bad |= {copy for copy, _ in problems}
                notes += [why for _, why in problems]
                continue
            t = time.perf_counter()
            failure, bad_copy = self._load(state_dict, d)
            self._lap("load", t)
            if failure is None:
                break
            notes.append(failure)
            if bad_copy is not None:  # one copy was bad: refuse it, try the others first
                bad.add(bad_copy)
                self._quarantine(bad_copy)
            else:
                bad_steps.add(d.step)
        else:
            d = Decision(FRESH, None, reason="gave up after too many failed attempts")
        if d.kind == PERSISTENT:
            self.persistent.restore(state_dict, d.step, self.load)  # its own layout and loader
        return self._finish(d, notes, t0)

    def _lap(self, phase: str, since: float) -> None:
        self.phases[phase] = self.phases.get(phase, 0.0) + time.perf_counter() - since

    # ------------------------------------------------------------------ phases
    def _gather_inventory(self):
        mine = (take_inventory(self.store, self.topo.node_rank, self.topo.ranks_of_node(self.topo.node_rank))
                if self.topo.local_rank == 0 else None)
        newest = None
        if self.topo.rank == 0 and self.persistent is not None:
            steps = self.persistent.steps()
            newest = steps[-1] if steps else None
        gathered = self.comm.all_gather((mine, newest))
        return [inv for inv, _ in gathered if inv is not None], gathered[0][1]

    def _gather_problems(self, mine: list[tuple[BadCopy, str]]) -> list[tuple[BadCopy, str]]:
        return [p for rank_problems in self.comm.all_gather(mine) for p in rank_problems]

    def _node_of(self, rank: int) -> int:
        return rank // self.topo.local_world_size

    def _fetch(self, d: Decision) -> list[tuple[BadCopy, str]]:
        """Fetch the metadata this node lacks. Shards are not fetched here: the reader streams
        them straight into the model (``_remote_read``), and the tmpfs copy is rebuilt after
        the load (``heal``), off the resume's critical path."""
        problems = []
        for f in d.fetches:
            if f.dst_rank != self.topo.rank or f.owner is not None:
                continue
            what = "metadata" if f.owner is None else f"rank {f.owner}'s shard"
            try:
                with self.store.fetch_lock(f.step, f.owner):
                    if f.owner is None:
                        self.transport.fetch_metadata(f.src_rank, f.step)
                    else:
                        self.bytes_fetched += self.transport.fetch_shard(f.src_rank, f.step, f.owner)
                log.info("mlcheckpoint: fetched %s of step %d from rank %d", what, f.step, f.src_rank)
            except (MLCheckpointError, OSError) as e:
                problems.append(((f.step, f.owner, self._node_of(f.src_rank)),
                                 f"fetching {what} of step {f.step} from rank {f.src_rank} failed: {e}"))
        return problems

    def _verify(self, d: Decision) -> list[tuple[BadCopy, str]]:
        """Check this node's copy of the step's metadata before anyone loads with it.

        Shard bytes are not hashed here: the reader verifies every item as it copies it into
        the model (one pass), and a mismatch names the bad copy, which is then refused and the
        load retried from another copy (see ``run``). Hashing up front would read every byte
        twice.
        """
        if self.topo.local_rank != 0:
            return []
        try:
            self.store.read_metadata(d.step, d.save_id)
        except CorruptShardError as e:
            node = self.topo.node_rank
            return [((d.step, None, node), f"node {node}: {e}")]
        except ShardNotFoundError:
            pass
        return []

    def _load(self, state_dict: dict, d: Decision) -> tuple[str | None, BadCopy | None]:
        self.bytes_fetched = 0  # count what the attempt that succeeds read, not failed ones
        remote = self.transport is not None
        reader = MemoryStorageReader(d.step, self.store, node=self.topo.node_rank,
                                     fetch=self._lazy_fetch if remote else None,
                                     remote=self._remote_read if remote else None,
                                     save_id=d.save_id)
        try:
            self.load(state_dict, reader)
        except MLCheckpointError as e:
            bad_copy = getattr(e, "copy", None)
            if bad_copy is not None and bad_copy[2] is not None:
                log.warning("mlcheckpoint: a copy of step %d is corrupt, trying another: %s", d.step, e)
                return f"step {d.step}: {e}", tuple(bad_copy)
            log.warning("mlcheckpoint: loading step %d failed, trying older: %s", d.step, e)
            return f"step {d.step} failed to load: {e}", None
        return None, None

    def _quarantine(self, copy: BadCopy) -> None:
        """Uncommit a copy found corrupt, on the node that holds it, so nobody reads it again."""
        step, owner, node = copy
        if node == self.topo.node_rank and self.topo.local_rank == 0 and owner is not None:
            log.warning("mlcheckpoint: refusing corrupt copy of rank %d's shard of step %d on node %d",
                        owner, step, node)
            self.store.retire_shard(step, owner)

    def _remote_read(self, step: int, owner: int, ranges, sinks, on_range=None) -> int:
        """Stream byte ranges of a shard this node lacks from a holder; return its node."""
        d = self.decision
        preferred = [f.src_rank for f in d.fetches if f.owner == owner
                     and self._node_of(f.dst_rank) == self.topo.node_rank]
        holders = [r for r in d.holders.get(owner, []) if self._node_of(r) != self.topo.node_rank]
        start = self.topo.rank % len(holders) if holders else 0
        errors = []
        for src in dict.fromkeys(preferred + holders[start:] + holders[:start]):
            try:
                self.bytes_fetched += self.transport.read_items(src, step, owner, ranges, sinks,
                                                                on_range)
                return self._node_of(src)
            except (MLCheckpointError, OSError) as e:
                errors.append(f"rank {src}: {e}")
        raise ShardNotFoundError(f"no holder could serve rank {owner}'s shard of step {step}: {errors}")

    def heal(self) -> list[tuple[int, int]]:
        """After a resume from memory: fetch this rank's own shard of the loaded step back into
        tmpfs when this node lacks it (a replaced node), so replication can protect it again.
        Runs after the load (the caller puts it on a background thread). Returns what it fetched."""
        d = self.decision
        done = []
        if d is None or d.kind != MEMORY or d.resharded or self.transport is None:
            return done
        owner = self.topo.rank
        if owner not in d.holders or owner in self.store.step_state(d.step).ranks_of(d.save_id):
            return done
        for src in [r for r in d.holders[owner] if self._node_of(r) != self.topo.node_rank]:
            try:
                with self.store.fetch_lock(d.step, owner):
                    self.transport.fetch_shard(src, d.step, owner)
                done.append((d.step, owner))
                log.info("mlcheckpoint: rebuilt rank %d's shard of step %d from rank %d", owner, d.step, src)
                break
            except (MLCheckpointError, OSError) as e:
                log.warning("mlcheckpoint: rebuilding rank %d's shard of step %d from rank %d failed: %s",
                            owner, d.step, src, e)
        return done

    def _lazy_fetch(self, step: int, owner: int | None) -> None:
        """The reader needs a shard this node lacks (DCP dedup or resharding): pull it."""
        d = self.decision
        holders = d.metadata_holders if owner is None else d.holders.get(owner, [])
        holders = [r for r in holders if self._node_of(r) != self.topo.node_rank]
        if not holders:
            raise ShardNotFoundError(f"no surviving node holds rank {owner}'s shard of step {step}")
        start = self.topo.rank % len(holders)  # spread readers over holders
        errors = []
        with self.store.fetch_lock(step, owner):
            if owner is not None and owner in self.store.step_state(step).ranks_of(d.save_id):
                return  # another rank of this node fetched it meanwhile
            for src in holders[start:] + holders[:start]:
                try:
                    if owner is None:
                        self.transport.fetch_metadata(src, step)
                    else:
                        self.bytes_fetched += self.transport.fetch_shard(src, step, owner)
                    return
                except (MLCheckpointError, OSError) as e:
                    errors.append(f"rank {src}: {e}")
        raise ShardNotFoundError(f"could not fetch rank {owner}'s shard of step {step}: {errors}")

    def _finish(self, d: Decision, notes: list[str], t0: float) -> ResumeInfo:
        if d.kind == MEMORY and d.lineage is not None:
            self.lineage = self.lineage.resumed(d.lineage, d.step)
        if self.transport is not None:  # before the last collective: partners push after it
            self.transport.accept_from(self.lineage)
        if self.topo.local_rank == 0:
            # Before the last collective: once it returns, other ranks may start saving (and
            # create files under step numbers this drop would otherwise race with).
            dropped = self.store.settle(self.lineage, d.step, set_aside=d.stranded)
            if dropped:
                log.info("mlcheckpoint: dropped steps %s newer than the resumed one on node %d",
                         dropped, self.topo.node_rank)
        source = {MEMORY: "peer" if self.bytes_fetched else "local", PERSISTENT: "persistent"}.get(d.kind)
        gathered = self.comm.all_gather((source, self.bytes_fetched))
        sources = {r: s for r, (s, _) in enumerate(gathered) if s is not None}
        overall = source
        if d.kind == MEMORY:
            overall = "peer" if "peer" in sources.values() else "local"
        reason = "; ".join([r for r in [d.reason, *notes] if r]) or None
        info = ResumeInfo(step=d.step, source=overall, seconds=time.perf_counter() - t0,
                          sources=sources, bytes_fetched=sum(b for _, b in gathered), reason=reason)
        if d.step is None:
            log.info("mlcheckpoint: no usable checkpoint, starting fresh (%s)", reason)
        else:
            log.info("mlcheckpoint: resumed step %d from %s in %.3fs (%d bytes from peers; %s)%s",
                     d.step, overall, info.seconds, info.bytes_fetched,
                     ", ".join(f"{k} {v:.3f}s" for k, v in self.phases.items()),
                     f"; {reason}" if reason else "")
        return info

"""Recovery for one rank: inventory -> plan -> fetch -> verify -> load -> heal, top to bottom.

Every rank runs the same pure planner on the same gathered inventories, so they agree on
the step; each fetch and verification problem is gathered too, and the planner runs again
without the bad copies, so all ranks move to the next candidate together.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.storage import StorageReader

from .._faults import pause_point
from .._gc import gc_paused
from ..collectives import Comm
from ..dcp import MemoryStorageReader
from ..dcp.errors import unwrap_checkpoint_exception
from ..dcp.reader import Refusals
from ..errors import CopyId, CorruptShardError, MLCheckpointError, ShardNotFoundError
from ..persistent import PersistentStorage
from ..replication import Replicator
from ..store import LocalStore
from ..store.identity import Lineage
from ..topology import Topology
from .holders import Holders
from .planner import (
    COPIES,
    FRESH,
    MEMORY,
    PERSISTENT,
    Decision,
    NodeInventory,
    PersistentStep,
    fallback_reason,
    plan_resume,
)

log = logging.getLogger(__name__)
MAX_ROUNDS = 16
MAX_JOBS_NAMED = 8  # other jobs a warning names (_other_jobs)
PHASES = ("inventory", "plan", "fetch", "verify", "load", "heal")  # ResumeInfo.phases, in order


@dataclass
class ResumeInfo:
    """What ``resume`` loaded: ``step`` is None (and ``source`` None) for a fresh start."""

    step: int | None
    # Job-wide, the same on every rank: "peer" if any rank's bytes came from another node
    # (also on a node that loaded its own shards locally), else "local"; "persistent" or None.
    # This rank's own: sources[rank].
    source: str | None
    seconds: float
    # rank -> where its bytes came from: "local", "peer", "persistent", or "copies" when its
    # own shard was on no surviving node (its items were read from the copies data
    # parallelism kept in other ranks' shards; ``reason`` names those ranks).
    sources: dict[int, str] = field(default_factory=dict)
    bytes_fetched: int = 0  # job-wide, from peers
    # Job-wide, the bytes read from peers for the load, per shard (its owner rank) and node that
    # served them ({owner: {node: bytes}}): how the reads spread over the holders. The rebuild
    # of a replaced node's own shard comes after, in the background, and is not counted.
    bytes_served: dict[int, dict[int, int]] = field(default_factory=dict)
    # None when the newest step in memory was loaded; else what failed, which newer steps were
    # refused and why, and what was loaded instead (persistent, fresh) and why.
    reason: str | None = None
    # True when the step was saved by another world size (DCP resharded it on load: an elastic
    # restart); None when that is not known (a persistent checkpoint does not record it).
    resharded: bool | None = False
    # Seconds this rank spent in each phase of the resume: inventory, plan, fetch, verify,
    # load (a persistent restore included) and heal (starting the re-protection; the rebuild
    # of a replaced node's shard goes on in the background). A phase that did not run is 0.
    phases: dict[str, float] = field(default_factory=dict)
    # Copies this rank's loads refused (bytes or a manifest that disagree with the step's
    # metadata), each also logged once where it was refused.
    refused_copies: int = 0
    # rank -> where its bytes came from, in words read without the docs: "local" (its own
    # node's memory), "from node N" (another node's memory, also when read through copies and
    # partial replicas: ``sources`` keeps those layout words), "persistent". The same on
    # every rank.
    labels: dict[int, str] = field(default_factory=dict)
    # One sentence: why this step and not a newer one (a newer step in memory not used, or
    # why memory did not serve); None when the newest step in memory was loaded.
    note: str | None = None
    # True when the job lost more than a save in flight: a persistent or fresh start while
    # memory held steps, memory lost altogether before a persistent load, or a memory step
    # older than the newest two. ``summary`` is then logged at WARNING, shown without any
    # logging configured.
    fell_back: bool = False

    @property
    def summary(self) -> str:
        """What was restored, in one line: the step, where from, the seconds, and why a newer
        step was not used (the line a resume prints on rank 0)."""
        if self.step is None:
            return f"nothing restored, starting fresh: {self.note or 'nothing was saved yet'}"
        if self.source == "persistent":
            line = f"restored step {self.step} from the persistent checkpoint in {self.seconds:.2f}s"
        else:
            places = set(self.labels.values())
            line = (f"restored step {self.step} {_by_rank(self.labels)} in {self.seconds:.2f}s"
                    if len(places) <= 1 else
                    f"restored step {self.step} in {self.seconds:.2f}s ({_by_rank(self.labels)})")
            if self.resharded:
                line += " (resharded: saved with another world size)"
        return f"{line}; {self.note}" if self.note else line

    def __str__(self) -> str:
        return self.summary


@dataclass
class Resumed:
    """What ``Recovery.run`` hands back to the manager."""

    info: ResumeInfo
    lineage: Lineage  # this run's, extended by the run it loaded from: later saves name it
    bytes_fetched: int  # by this rank, from peers
    healing: threading.Thread | None  # rebuilding this rank's own shard in the background
    # The step loaded, where some rank of the job rebuilds its own shard of it from other
    # nodes' memory in the background (the same on every rank); None otherwise.
    rebuilt_step: int | None = None


class Recovery:
    """One rank's part of a resume.

    ``group`` is the checkpoint process group ``dcp.load`` runs on; ``replicator`` is None
    when replication is off (then every node must hold what its own ranks need).
    """

    def __init__(self, store: LocalStore, topology: Topology, comm: Comm, *, lineage: Lineage,
                 group: dist.ProcessGroup | None, replicator: Replicator | None = None,
                 persistent: PersistentStorage | None = None, announce: bool = False):
        self.store, self.topo, self.comm = store, topology, comm
        self.lineage, self.group = lineage, group
        self.replicator, self.persistent = replicator, persistent
        self.transport = replicator.transport if replicator is not None else None
        self.phases: dict[str, float] = dict.fromkeys(PHASES, 0.0)  # ResumeInfo.phases
        self.refusals = Refusals()  # the copies this rank's loads refused, each said once
        self.announce = announce  # rank 0 logs ResumeInfo.summary (CheckpointManager.resume)

    def run(self, state_dict: dict) -> Resumed:
        """Load the newest usable checkpoint into ``state_dict``; every rank calls it."""
        t0 = time.perf_counter()
        self.store.gc(ranks=[self.topo.rank])  # what a crash of this rank left behind
        nodes, newest_persistent = self._gather_inventory()
        persistent_step = newest_persistent.step if newest_persistent is not None else None
        self._lap("inventory", t0)
        bad: set[CopyId] = set()
        bad_steps: set[int] = set()
        notes: list[str] = []
        holders: Holders | None = None  # reads from other nodes, for the step being tried
        for attempt in range(MAX_ROUNDS):
            if attempt:
                # A copy was refused (and retired where it lay) or a read failed: plan again
                # from what every node holds now, not from what it held before the loop (a
                # node whose last shard of a step was retired may need that step's metadata
                # fetched, or hold nothing of it any more).
                t = time.perf_counter()
                nodes, _ = self._gather_inventory(persistent=False)
                self._lap("inventory", t)
            t = time.perf_counter()
            d = plan_resume(nodes, persistent_step, self.topo.world_size, bad_copies=bad,
                            bad_steps=bad_steps, can_fetch=self.transport is not None,
                            places=2 if self.replicator is None else self.replicator.places,
                            persistent=newest_persistent)
            self._lap("plan", t)
            holders = None
            if d.kind != MEMORY:
                break
            assert d.step is not None  # a plan from memory names its step
            if self.transport is not None:
                holders = Holders(self.transport, self.store, self.topo, d)
            t = time.perf_counter()
            fetch_problems = self._fetch(d, holders)
            self._lap("fetch", t)
            t = time.perf_counter()
            # One gather for both: the plan names each node's leader to fetch its metadata,
            # and the same rank checks it (unless its fetch failed).
            problems = self._gather_problems(fetch_problems or self._verify(d.step, d.save_id))
            self._lap("verify", t)
            if problems:
                bad |= {copy for copy, _ in problems}
                notes += [why for _, why in problems]
                continue
            t = time.perf_counter()
            failure, bad_copy = self._load(state_dict, d, holders)
            self._lap("load", t)
            if failure is None:
                break
            notes.append(failure)
            if bad_copy is not None:  # one copy was bad: refuse it, try the others first
                bad.add(bad_copy)
                self._quarantine(bad_copy, d)
            else:
                bad_steps.add(d.step)
        else:  # every round refused another copy: memory cannot serve, persistent still may
            kind, step = (PERSISTENT, persistent_step) if persistent_step is not None else (FRESH, None)
            d = Decision(kind, step, newest_protected=d.newest_protected,
                         reason=f"gave up on memory after {MAX_ROUNDS} failed attempts; "
                                + fallback_reason(step, memory_held_steps=True),
                         skipped={} if d.step is None else
                         {d.step: f"{MAX_ROUNDS} attempts to read it failed"})
            holders = None
        # The same on every rank, and so is the collective in _other_jobs.
        elsewhere = self._other_jobs(d) if not any(inv.steps for inv in nodes) else []
        if d.kind == PERSISTENT:
            assert self.persistent is not None and d.step is not None
            # Its own layout and reader; a framework's folder may load it its own way.
            t = time.perf_counter()
            self.persistent.restore(state_dict, d.step, functools.partial(load_step, group=self.group))
            self._lap("load", t)
        fetched = holders.bytes_fetched if holders is not None else 0
        info = self._finish(d, [*notes, d.reason, *elsewhere], t0, fetched,
                            holders.bytes_served if holders is not None else {},
                            memory_held=any(inv.steps for inv in nodes))
        t = time.perf_counter()
        healing = self._heal(d, holders)  # after the last collective, in the background
        self._lap("heal", t)
        info.phases = dict(self.phases)
        if self.announce and self.topo.rank == 0:  # one line per launch; WARNING is shown unasked
            log.log(logging.WARNING if info.fell_back else logging.INFO, "mlcheckpoint: %s", info.summary)
        rebuilt = holders is not None and any(self._rebuilds(d, r) for r in d.sources)
        return Resumed(info, self.lineage, fetched, healing, d.step if rebuilt else None)

    def continue_from(self, step: int | None) -> None:
        """The job continues from ``step``, restored without ``run`` (e.g. a framework loaded
        its own checkpoint): every node settles as after a resume of that step."""
        self._settle(step)
        self.comm.all_gather(None)  # no rank saves before every node has settled
        if self.replicator is not None:
            self.replicator.activate(reset=True)

    def _lap(self, phase: str, since: float) -> None:
        self.phases[phase] = self.phases.get(phase, 0.0) + time.perf_counter() - since

    # ------------------------------------------------------------------ inventory
    def _gather_inventory(self, persistent: bool = True) -> tuple[list[NodeInventory], PersistentStep | None]:
        """Each node's inventory (taken by its local rank 0), and (with ``persistent``) the
        newest persistent step with what is known of its origin (listed by rank 0): one
        all_gather."""
        node = self.topo.node_rank
        mine = (NodeInventory(node, self.topo.ranks_of_node(node), self.store.inventory.all())
                if self.topo.is_node_leader else None)
        newest: PersistentStep | None = None
        if persistent and self.topo.rank == 0 and self.persistent is not None:
            steps = self.persistent.steps()
            if steps:
                origin = self.persistent.origin(steps[-1])
                newest = PersistentStep(steps[-1], _written_at(self.persistent, steps[-1]),
                                        None if origin is None else origin.run_id,
                                        None if origin is None else origin.created)
        gathered = self.comm.all_gather((mine, newest))
        return [inv for inv, _ in gathered if inv is not None], gathered[0][1]

    def _other_jobs(self, d: Decision) -> list[str]:
        """Memory holds nothing of this job on any node. If other jobs under ``local_dir`` hold
        steps, this run may have resolved the wrong job id (a restart that forgot
        MLCHECKPOINT_JOB_ID and derived one): say so once, from rank 0, at WARNING (shown even
        with no logging set up), and in the reason on every rank. One all_gather."""
        mine = self.store.other_jobs() if self.topo.is_node_leader else {}
        found: dict[str, dict[int, int]] = {}  # job -> node -> newest step there
        for node, jobs in self.comm.all_gather((self.topo.node_rank, mine)):
            for job, step in jobs.items():
                found.setdefault(job, {})[node] = step
        if not found:
            return []
        names = sorted(found, key=lambda job: (-max(found[job].values()), job))
        listed = ", ".join(f"{job} (newest step {max(found[job].values())}, on node"
                           f"{'s' if len(found[job]) > 1 else ''} "
                           f"{', '.join(map(str, sorted(found[job])))})" for job in names[:MAX_JOBS_NAMED])
        more = f" and {len(names) - MAX_JOBS_NAMED} more" if len(names) > MAX_JOBS_NAMED else ""
        note = (f"memory holds no step of job {self.store.job_id!r}, but other jobs under local_dir "
                f"do: {listed}{more}; to resume one of them, restart with its id as "
                "CheckpointManager(job_id=...) or MLCHECKPOINT_JOB_ID")
        if self.topo.rank == 0:
            doing = "starts fresh" if d.step is None else f"loads persistent step {d.step}"
            log.warning("mlcheckpoint: %s (the id must stay the same across restarts). This run "
                        "%s. If those jobs are done, remove their directories to free the memory "
                        "they hold.", note, doing)
        return [note]

    def _gather_problems(self, mine: list[tuple[CopyId, str]]) -> list[tuple[CopyId, str]]:
        return [p for rank_problems in self.comm.all_gather(mine) for p in rank_problems]

    # ------------------------------------------------------------------ fetch and verify
    def _fetch(self, d: Decision, holders: Holders | None) -> list[tuple[CopyId, str]]:
        """Fetch the metadata this node lacks (the plan names the node's leader for it).

        Shards are not fetched here: the reader streams them straight into the model
        (``Holders.read_runs``), and a replaced node's own shard is rebuilt after the load
        (``_heal``), off the resume's critical path."""
        mine = [f for f in d.fetches if f.dst_rank == self.topo.rank]
        if not mine or holders is None:
            return []
        try:
            holders.fetch_metadata()
        except (MLCheckpointError, OSError) as e:
            # Refuse the copy the plan chose; the next plan picks another holder.
            src = mine[0].src_rank
            return [(CopyId(holders.step, None, self.topo.node_of(src)),
                     f"fetching the metadata of step {holders.step} failed: {e}")]
        return []

    def _verify(self, step: int, save_id: str) -> list[tuple[CopyId, str]]:
        """Check this node's copy of the step's metadata before anyone loads with it.

        Shard bytes are not hashed here: the reader verifies every item as it copies it into
        the model (one pass), and a mismatch names the bad copy, which is then refused and the
        load retried from another copy (see ``run``). Hashing up front would read every byte
        twice.
        """
        if not self.topo.is_node_leader:
            return []
        node = self.topo.node_rank
        try:
            self.store.metadata.read(step, save_id)
        except (CorruptShardError, ShardNotFoundError) as e:
            # Missing: gone since the inventory (every rank of the node would fail in dcp.load);
            # the next plan fetches it from a node that holds it.
            return [(CopyId(step, None, node), f"node {node}: {e}")]
        return []

    # ------------------------------------------------------------------ load
    def _load(self, state_dict: dict, d: Decision,
              holders: Holders | None) -> tuple[str | None, CopyId | None]:
        """dcp.load with a reader over this node's store and, for shards this node lacks,
        ``holders``. Returns (why it failed, the bad copy if one copy is to blame)."""
        assert d.step is not None
        reader = MemoryStorageReader(d.step, self.store, node=self.topo.node_rank, remote=holders,
                                     save_id=d.save_id, refusals=self.refusals)
        pause_point("resume_load", d.step, self.topo.rank)
        try:
            load_step(state_dict, reader, self.group)
        except MLCheckpointError as e:
            copy = e.copy if isinstance(e, CorruptShardError) else None
            if copy is not None and copy.node is not None:
                log.warning("mlcheckpoint: a copy of step %d is corrupt, trying another: %s", d.step, e)
                return f"step {d.step}: {e}", copy
            log.warning("mlcheckpoint: loading step %d failed, trying older: %s", d.step, e)
            return f"step {d.step} failed to load: {e}", None
        return None, None

    def _quarantine(self, copy: CopyId, d: Decision) -> None:
        """Uncommit a copy found corrupt, on the node that holds it, so nobody reads it again.
        The step's metadata stays there while another node holds the step (``d``'s holders):
        this node may still load it from them."""
        if copy.node == self.topo.node_rank and self.topo.is_node_leader and copy.owner is not None:
            log.warning("mlcheckpoint: refusing corrupt copy of rank %d's shard of step %d on node %d",
                        copy.owner, copy.step, copy.node)
            held = [*d.metadata_holders, *(r for ranks in d.holders.values() for r in ranks)]
            elsewhere = any(self.topo.node_of(r) != copy.node for r in held)
            self.store.shards.retire(copy.step, copy.owner, keep_metadata=elsewhere)

    # ------------------------------------------------------------------ finish and heal
    def _finish(self, d: Decision, reasons: list[str], t0: float, fetched: int,
                served: dict[int, dict[int, int]], *, memory_held: bool) -> ResumeInfo:
        """``reasons``: what failed on the way, in order, then the last plan's reason (what
        was refused and what is loaded), then anything else worth knowing."""
        if d.kind == MEMORY and d.lineage is not None and d.step is not None:
            self.lineage = self.lineage.resumed(d.lineage, d.step)
        if self.transport is not None:  # before the last collective: partners push after it
            self.transport.sink.accept_from(self.lineage)
        # Before the last collective: once it returns, other ranks may start saving (and
        # create files under step numbers this drop would otherwise race with).
        self._settle(d.step, set_aside=d.stranded)
        source = {MEMORY: "peer" if fetched else "local", PERSISTENT: "persistent"}.get(d.kind)
        if d.kind == MEMORY and d.sources.get(self.topo.rank) == COPIES:
            source = COPIES
        gathered = self.comm.all_gather((source, fetched, served))
        pause_point("resume_agreed", d.step, self.topo.rank)  # tests: other ranks save from here
        sources = {r: s for r, (s, _, _) in enumerate(gathered) if s is not None}
        bytes_served: dict[int, dict[int, int]] = {}
        for _, _, rank_served in gathered:
            for owner, by_node in rank_served.items():
                mine = bytes_served.setdefault(owner, {})
                for node, nbytes in by_node.items():
                    mine[node] = mine.get(node, 0) + nbytes
        overall = source
        if d.kind == MEMORY:
            overall = "peer" if any(b for _, b, _ in gathered) else "local"
        reason = "; ".join(r for r in reasons if r) or None
        resharded = {MEMORY: d.resharded, PERSISTENT: None}.get(d.kind, False)
        note, fell_back = _note(d, memory_held)
        info = ResumeInfo(step=d.step, source=overall, seconds=time.perf_counter() - t0,
                          sources=sources, bytes_fetched=sum(b for _, b, _ in gathered),
                          bytes_served={o: dict(sorted(n.items())) for o, n in sorted(bytes_served.items())},
                          reason=reason,
                          resharded=resharded, refused_copies=len(self.refusals),
                          labels={r: _label(s, rank_served) for r, (s, _, rank_served)
                                  in enumerate(gathered) if s is not None},
                          note=note, fell_back=fell_back)
        # The line a user reads is ResumeInfo.summary, logged once on rank 0 (``run``); this
        # one, per rank, keeps the layout words and the phases for debugging.
        log.debug("mlcheckpoint: rank %d: %s; sources %s, %d bytes from peers, phases %s%s",
                  self.topo.rank, info.summary, sources, info.bytes_fetched,
                  ", ".join(f"{k} {v:.3f}s" for k, v in self.phases.items() if k != "heal"),
                  f"; {reason}" if reason else "")
        return info

    def _settle(self, step: int | None, set_aside: Iterable[int] = ()) -> None:
        """On each node's local rank 0: drop what does not belong to the job's history up to
        ``step`` (LocalStore.settle)."""
        if not self.topo.is_node_leader:
            return
        dropped = self.store.settle(self.lineage, step, set_aside=set_aside)
        if dropped:
            log.info("mlcheckpoint: dropped steps %s newer than step %s on node %d", dropped,
                     step, self.topo.node_rank)

    def _heal(self, d: Decision, holders: Holders | None) -> threading.Thread | None:
        """Re-protect what was loaded now, not at the next save: the newest step that survived
        on two nodes is kept until a newer one is protected, the replicator restarts, and a
        replaced node's rank gets its own shard back as the save left it (on a background
        thread, off the resume's critical path, paced). Every rank's own shard is then on its
        own node, so the replicator's rounds of the loaded step push each partner what lacks
        places (``coverage.plan_push``), as after a save: every item regains its places, and
        ``wait_replicated`` says when. A round named before the shard is back leaves the step
        unprotected and is named again (``Replicator._propose_next``)."""
        if self.replicator is None:
            return None
        self.replicator.seed_protected(d.newest_protected)
        self.replicator.activate(reset=True)
        # The plan's "peer" (its own shard is whole only on other nodes; never when resharded:
        # the saved ranks are not this job's ranks) or COPIES (whole on no node) for this rank:
        # its shard is assembled from its items' places (Holders.rebuild).
        if holders is None or not self._rebuilds(d, self.topo.rank):
            return None
        thread = threading.Thread(target=self._rebuild_own_shard, args=(holders, self.replicator),
                                  name="mlckpt-heal", daemon=True)
        thread.start()
        return thread

    def _rebuilds(self, d: Decision, rank: int) -> bool:
        """Whether ``rank`` brings its own shard of the loaded step back after the load (its
        node lacked it), with replication on."""
        return self.replicator is not None and d.sources.get(rank) in ("peer", COPIES)

    def _rebuild_own_shard(self, holders: Holders, replicator: Replicator) -> None:
        try:
            pause_point("heal_rebuild", holders.step, self.topo.rank)
            if holders.rebuild(self.topo.rank):
                replicator.wake()
        except (MLCheckpointError, OSError) as e:
            log.warning("mlcheckpoint: rebuilding rank %d's shard of step %d failed: %s; the "
                        "step stays unprotected until a newer one is saved and replicated",
                        self.topo.rank, holders.step, e)


def load_step(state_dict: dict[str, Any], reader: StorageReader,
              group: dist.ProcessGroup | None) -> None:
    """The load itself: into ``state_dict`` (in place) with ``dcp.load`` on ``group`` (the
    checkpoint group, never the training group). Our errors (e.g. CorruptShardError naming the
    bad copy) come out as themselves, whichever rank raised them."""
    try:
        with gc_paused():
            dcp.load(state_dict, storage_reader=reader, process_group=group)
    except CheckpointException as e:
        raise unwrap_checkpoint_exception(e, "load") from None


def _label(source: str, served: dict[int, dict[int, int]]) -> str:
    """A rank's ``ResumeInfo.labels`` entry from its source and the nodes it read from."""
    if source not in ("peer", COPIES):
        return source  # "local", "persistent"
    nodes = sorted({node for by_node in served.values() for node in by_node})
    if not nodes:  # copies on its own node: nothing was read from another
        return "local"
    return f"from node{'s' if len(nodes) > 1 else ''} {', '.join(map(str, nodes))}"


def _by_rank(labels: dict[int, str]) -> str:
    """``labels`` in a few words: "from local memory", or "ranks 0-3 local, ranks 4-7 from
    node 0"."""
    groups: dict[str, list[int]] = {}
    for rank, label in sorted(labels.items()):
        groups.setdefault(label, []).append(rank)
    if len(groups) <= 1:
        label = next(iter(groups), "local")
        return "from local memory" if label == "local" else label
    return ", ".join(f"{_ranks(ranks)} {label}" for label, ranks in groups.items())


def _ranks(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "ranks 0-2, 5"; [3] -> "rank 3"."""
    spans: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        spans.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(spans)}"


def _note(d: Decision, memory_held: bool) -> tuple[str | None, bool]:
    """``ResumeInfo.note`` and ``fell_back`` from the plan that was carried out."""
    newer = sorted((s for s in d.skipped if d.step is None or s > d.step), reverse=True)
    note = None
    if newer:
        why = d.skipped[newer[0]].split("; ")[0]
        older = (f" (nor {len(newer) - 1} older step{'s' if len(newer) > 2 else ''})"
                 if len(newer) > 1 else "")
        note = (f"{'newer ' if d.step is not None else ''}step {newer[0]} in memory was not "
                f"used{older}: {why}")
        if d.kind == FRESH:
            note += "; there is no persistent checkpoint"
    elif d.kind != MEMORY:
        # The planner's last clause says why memory did not serve, ending in what it loads.
        last = d.reason.split("; ")[-1] if d.reason else ""
        note = last.split(": loading")[0].split(": starting fresh")[0] or None
    fell_back = (len(newer) > 1 or (d.kind == PERSISTENT and (bool(newer) or not memory_held))
                 or (d.kind == FRESH and memory_held))
    return note, fell_back


def _written_at(persistent: PersistentStorage, step: int) -> float | None:
    """When a persistent step was finished: its folder's mtime (DCP renames the step's metadata
    into it last). None for a URL, whose store may keep no such time."""
    if persistent.is_url:
        return None
    try:
        return os.stat(persistent.path(step)).st_mtime
    except OSError:
        return None

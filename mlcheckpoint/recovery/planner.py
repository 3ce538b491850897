"""The recovery planner: a pure function from what survived to what to load.

No I/O, no torch.distributed: every rank runs it on the same gathered inputs and reaches
the same decision. Inputs: each node's inventory, the newest persistent step, the current
world size, and copies found bad so far. Output: the step and where its bytes come from,
or "persistent", or "fresh".

A step is one *save*: its metadata and shards name the same save id, and only copies of that
save count towards it. The newest save any node holds fixes the job's history (its run and the
runs it descends from); saves outside that history (another incarnation of the job, e.g. a node
that comes back with an older run's memory) are never candidates.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..errors import CopyId
from ..store import coverage
from ..store.coverage import WHOLE, Held
from ..store.identity import Lineage
from ..store.inventory import StepState

MEMORY, PERSISTENT, FRESH = "memory", "persistent", "fresh"
COPIES = "copies"  # Decision.sources: the rank's own shard is on no node; its items come from copies
# A persistent step with no origin record counts as written before a memory save only by
# more than this: the persistent folder's clock (a file server's) and the coordinator's may
# disagree a little.
CLOCK_SLACK_S = 5.0


@dataclass
class NodeInventory:
    """What one node holds, as its local rank 0 lists it at job start (one collective gathers
    every node's): the planner's input."""

    node: int
    ranks: list[int]  # current ranks on this node (any of them can serve its store)
    steps: dict[int, StepState] = field(default_factory=dict)  # the store's ``inventory.all()``


@dataclass(frozen=True)
class PersistentStep:
    """The newest persistent step, and what is known of where it comes from."""

    step: int
    written: float | None = None  # its folder's modification time (the file server's clock)
    run_id: str | None = None  # the run that wrote it, from its origin record (None: no record)
    created: float | None = None  # when that run wrote it, by the job's own clock


@dataclass(frozen=True)
class Fetch:
    """``dst_rank`` pulls the global metadata of ``step`` from ``src_rank`` (before the load).

    Shards are never fetched on the plan's word: the plan says which nodes hold which items
    (``Decision.holders``, ``partial``), and the reads are dealt over them where they are made
    (``dcp/remote.py`` ``deal``, for the load and for a rebuild alike)."""

    dst_rank: int
    src_rank: int
    step: int


@dataclass
class Decision:
    kind: str  # MEMORY, PERSISTENT or FRESH
    step: int | None
    fetches: list[Fetch] = field(default_factory=list)  # the metadata, one per node lacking it
    # owner -> ranks of the nodes holding its shard, whole or a partial replica (``partial``)
    holders: dict[int, list[int]] = field(default_factory=dict)
    metadata_holders: list[int] = field(default_factory=list)
    # rank -> "peer" when the rank's own shard is on no node of its own (a replaced node:
    # recovery rebuilds it there after the load), COPIES when it is on no surviving node at
    # all (its items are read from the copies data parallelism kept in other ranks' shards
    # and its partial replicas; recovery rebuilds it from them after the load), else "local"
    # (also when resharded).
    sources: dict[int, str] = field(default_factory=dict)
    # Owners whose shard is whole on no surviving node: the reader reads their items from
    # copies and partial replicas.
    through_copies: list[int] = field(default_factory=list)
    # owner -> node -> offsets of the items its partial replica of the owner's shard holds
    # (only the items that lacked places were sent); a holder node not named holds it whole
    partial: dict[int, dict[int, frozenset[int]]] = field(default_factory=dict)
    # owner -> the bytes of its shard's data, as any copy of it on a survivor has them (a
    # partial replica's file is as long as the shard): a shard rebuilt from its items' places
    # takes this size, so it is the very shard its partial replicas describe
    data_bytes: dict[int, int] = field(default_factory=dict)
    resharded: bool = False  # saved with another world size: DCP reshards, reads fetch lazily
    newest_protected: int | None = None  # newest step with every shard on ``copies`` nodes
    reason: str = ""
    save_id: str = ""  # the save of ``step`` to load: every copy read must name it
    lineage: Lineage | None = None  # the loaded save's run and ancestors
    history: Lineage | None = None  # the history of the newest save found (None: nothing found)
    stranded: list[int] = field(default_factory=list)  # complete newer steps not chosen
    # step -> why it was skipped (a newer step than the one chosen), for ResumeInfo.summary
    skipped: dict[int, str] = field(default_factory=dict)


def plan_resume(nodes: list[NodeInventory], persistent_step: int | None, world_size: int, *,
                bad_copies: Iterable[CopyId] = (), bad_steps: Iterable[int] = (),
                can_fetch: bool = True, places: int = 2,
                persistent: PersistentStep | None = None) -> Decision:
    """Pick the newest step complete among the surviving nodes; a newer persistent step wins,
    unless it belongs to an earlier history than the memory step (``earlier_history``: a run
    that started over without resuming, or continued from an older step, saved the memory
    step after the persistent one was written). ``persistent`` describes the step
    ``persistent_step`` names (None: nothing is known of its origin).

    A step is complete when its metadata is on some node and every item of every required
    rank is (``store/coverage.py``): in its owner's shard, a partial replica listing it, or,
    where data parallelism kept copies of it in other ranks' shards (the metadata's copy
    groups), a shard holding a copy (not counting copies in ``bad_copies``; never a step in
    ``bad_steps``). Without a transport (``can_fetch`` False) every node must hold what its
    own ranks need. A step counts as protected (``newest_protected``) when its metadata and
    every item are on ``places`` nodes (1 + the job's ``replicas``).
    """
    bad = set(bad_copies)
    excluded_steps = set(bad_steps)
    history, foreign, view = _survivors(nodes, bad)
    reasons: list[str] = []
    newest_protected = _newest_protected(view, places)
    stranded: list[int] = []
    skipped: dict[int, str] = {}
    persistent_newer = False
    if foreign:
        reasons.append(f"steps {_few(foreign)} belong to another run of this job and are ignored")
    earlier = False  # the persistent step belongs to an earlier history
    for step in sorted(view, reverse=True):
        if persistent_step is not None and persistent_step > step:
            origin = persistent if persistent is not None and persistent.step == persistent_step else None
            if earlier_history(origin, history, view[step].created):
                reasons.append(f"persistent step {persistent_step} was written before memory "
                               f"step {step} was saved, by a run this memory does not descend "
                               "from: it belongs to an earlier history and is not loaded")
                persistent_step, earlier = None, True
            else:
                persistent_newer = True
                reasons.append(f"persistent step {persistent_step} is newer than memory step "
                               f"{step}: loading it")
                break
        if step in excluded_steps:
            reasons.append(f"step {step} failed earlier")
            skipped[step] = "it failed to load"
            stranded.append(step)
            continue
        why = _incomplete(view[step])
        if why is None:
            decision = _fetch_plan(step, view[step], nodes, world_size, can_fetch)
            if decision is not None:
                if decision.through_copies:
                    partly = any(o in decision.partial for o in decision.through_copies)
                    reasons.append(f"the shards of ranks {_few(decision.through_copies)} are whole "
                                   "on no surviving node: their items are read from "
                                   + ("their partial replicas and " if partly else "")
                                   + "the copies other ranks' shards keep")
                decision.reason = "; ".join(reasons)
                decision.newest_protected = newest_protected
                decision.history, decision.stranded = history, stranded
                decision.skipped = skipped
                return decision
            why = "needs fetching but replication is off"
            stranded.append(step)
        reasons.append(f"step {step} unusable: {why}")
        skipped[step] = why
    kind, step_ = (PERSISTENT, persistent_step) if persistent_step is not None else (FRESH, None)
    if earlier:
        reasons.append("no step in memory is usable: starting fresh")
    elif not persistent_newer:
        reasons.append(fallback_reason(step_, bool(view) or bool(foreign)))
    return Decision(kind, step_, reason="; ".join(reasons), skipped=skipped,
                    newest_protected=newest_protected, history=history,
                    stranded=[s for s in stranded if step_ is None or s > step_])


def earlier_history(persistent: PersistentStep | None, history: Lineage | None,
                    memory_created: float) -> bool:
    """Whether a higher-numbered persistent step belongs to an earlier history than a memory
    save made at ``memory_created`` (by the job's clock) whose history is ``history``.

    With an origin record: never when the memory's history descends from the run that wrote
    it (at or after that step); otherwise when that run wrote it before the memory save was
    made, both times by the job's own clocks. Without one (a framework's folder, or an older
    write): when the folder's time is well before the save (``CLOCK_SLACK_S``: a file
    server's clock may disagree a little)."""
    if persistent is None:
        return False
    if persistent.run_id is not None and persistent.created is not None:
        if history is not None and history.admits(persistent.run_id, persistent.step):
            return False
        return persistent.created < memory_created
    return persistent.written is not None and persistent.written < memory_created - CLOCK_SLACK_S


def fallback_reason(persistent_step: int | None, memory_held_steps: bool) -> str:
    """Why memory did not serve and what is loaded instead: the last clause of a reason."""
    memory = ("no step in memory is usable" if memory_held_steps
              else "memory holds no checkpoint of this job")
    if persistent_step is not None:
        return f"{memory}: loading persistent step {persistent_step}"
    return f"{memory} and there is no persistent checkpoint: starting fresh"


@dataclass(frozen=True)
class StepVerdict:
    """What ``plan_resume`` makes of one step from the holdings it is given."""

    complete: bool  # its metadata and every item of every rank it needs are held
    required: tuple[int, ...] | None = None  # the ranks it needs (None: no usable metadata)
    missing: tuple[int, ...] = ()  # of those, ranks with an item held nowhere
    foreign: bool = False  # another run of the job saved it: never a candidate
    reason: str = ""  # why it is not complete, in the planner's words ("" when it is)


def step_verdicts(nodes: list[NodeInventory], *,
                  bad_copies: Iterable[CopyId] = ()) -> dict[int, StepVerdict]:
    """Per step the nodes hold, whether ``plan_resume`` over the same inventories and bad
    copies counts it complete: a candidate it loads unless a newer one is loaded, a newer
    persistent step wins, the step failed before, or it needs fetching with no transport.

    The planner's own rule, not a second one (``mlcheckpoint ls``/``verify`` and
    ``checkpoints()`` call it over one node's inventory): only saves of the newest save's
    history count, each item is held in its owner's shard, a partial replica listing it, or a
    shard keeping a data-parallel copy (``store/coverage.py``), and damaged or bad copies are
    absent. ``missing`` names the ranks whose items are not all held."""
    bad = set(bad_copies)
    _, foreign, view = _survivors(nodes, bad)
    out = {step: StepVerdict(False, foreign=True, reason="it belongs to another run of this job")
           for step in foreign if step not in view}
    for step, v in view.items():
        why = _incomplete(v)
        missing = () if v.required is None else coverage.unreadable(v.required, v.copy_groups, v.holdings)
        out[step] = StepVerdict(why is None, None if v.required is None else tuple(v.required),
                                tuple(missing), reason=why or "")
    return dict(sorted(out.items()))


def _survivors(nodes: list[NodeInventory], bad: set[CopyId]
               ) -> tuple[Lineage | None, list[int], dict[int, _StepView]]:
    """What ``plan_resume`` and ``step_verdicts`` both start from: the history of the newest
    save, the steps of other runs (foreign), and what the nodes hold of every other step."""
    history = _history(nodes, bad)
    foreign = _foreign_steps(nodes, history)
    return history, foreign, _holdings(nodes, bad, history, set(foreign))


@dataclass
class _StepView:
    save_id: str = ""
    lineage: Lineage | None = None
    created: float = 0.0  # when the save was made (its coordinator's clock)
    required: tuple[int, ...] | None = None
    world_size: int | None = None
    copy_groups: coverage.CopyGroups = field(default_factory=dict)  # store/coverage.py
    meta_nodes: list[int] = field(default_factory=list)
    owner_nodes: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))  # whole
    # owner -> node -> what the node holds of its shard (whole or a partial replica's groups)
    holdings: dict[int, dict[int, Held]] = field(default_factory=lambda: defaultdict(dict))
    data_bytes: dict[int, int] = field(default_factory=dict)  # Decision.data_bytes
    partial: dict[int, dict[int, frozenset[int]]] = field(default_factory=dict)  # Decision.partial
    refused: set[int] = field(default_factory=set)  # owners with a copy that failed verification
    damage: list[str] = field(default_factory=list)  # what the inventories found wrong


def _metadata_copies(nodes: list[NodeInventory], bad: set[CopyId]):
    """(node inventory, step, copy) for every usable metadata copy on a node with live ranks."""
    for inv in nodes:
        if not inv.ranks:
            continue  # a node without live ranks cannot serve anything
        for step, copy in inv.steps.items():
            if copy.has_metadata and CopyId(step, None, inv.node) not in bad:
                yield inv, step, copy


def _history(nodes: list[NodeInventory], bad: set[CopyId]) -> Lineage | None:
    """The history of the newest save any surviving node holds (by its coordinator's clock):
    that save's run and the runs it descends from. Runs are minutes apart, clocks of one
    cluster far closer, so the newest save belongs to the run that ran last."""
    newest = max(_metadata_copies(nodes, bad), default=None,
                 key=lambda found: (found[2].created, found[2].save_id, found[1]))
    return None if newest is None else newest[2].lineage


def _foreign_steps(nodes: list[NodeInventory], history: Lineage | None) -> list[int]:
    return sorted({step for _, step, c in _metadata_copies(nodes, set())
                   if history is not None and not history.admits(c.run_id, step)})


def _chosen_saves(nodes: list[NodeInventory], bad: set[CopyId],
                  history: Lineage | None) -> dict[int, StepState]:
    """Per step, the newest save of it that belongs to ``history`` (a step saved twice in one
    run counts as its later save)."""
    chosen: dict[int, StepState] = {}
    for _, step, c in _metadata_copies(nodes, bad):
        if history is None or not history.admits(c.run_id, step):
            continue
        if step not in chosen or (c.created, c.save_id) > (chosen[step].created, chosen[step].save_id):
            chosen[step] = c
    return chosen


def _holdings(nodes: list[NodeInventory], bad: set[CopyId], history: Lineage | None,
              foreign: set[int]) -> dict[int, _StepView]:
    chosen = _chosen_saves(nodes, bad, history)
    view: dict[int, _StepView] = {}
    for step, meta in chosen.items():
        view[step] = _StepView(save_id=meta.save_id or "", lineage=meta.lineage,
                               created=meta.created, world_size=meta.world_size,
                               required=meta.required_ranks, copy_groups=meta.copy_groups)
    for inv, step, copy in _metadata_copies(nodes, bad):
        if step in view and copy.save_id == view[step].save_id:
            view[step].meta_nodes.append(inv.node)
    for inv in nodes:
        if not inv.ranks:
            continue
        for step, copy in inv.steps.items():
            if step not in view and step not in foreign:
                view[step] = _StepView()  # shards without metadata: listed, never usable
            v = view.get(step)
            if v is None or v.required is None:
                continue  # no usable metadata of this step names a save of our history
            for owner, why in copy.damaged.items():  # listed by its node, unusable: refused
                v.refused.add(owner)
                v.damage.append(f"node {inv.node}: {why}")
            for owner, nbytes in copy.shard_bytes.items():
                if copy.shard_saves.get(owner) != v.save_id:
                    continue  # a shard of another save of this step: never part of this one
                if CopyId(step, owner, inv.node) in bad:
                    v.refused.add(owner)
                    continue
                held = copy.partial.get(owner, WHOLE)
                v.holdings[owner][inv.node] = held
                v.data_bytes.setdefault(owner, nbytes)
                if held.whole:
                    v.owner_nodes[owner].append(inv.node)
                else:  # a partial replica: it serves the items it holds
                    v.partial.setdefault(owner, {})[inv.node] = held.items or frozenset()
    return view


def _incomplete(v: _StepView) -> str | None:
    if not v.meta_nodes or v.required is None:
        return "no surviving node has its metadata"
    missing = coverage.unreadable(v.required, v.copy_groups, v.holdings)
    if missing:
        corrupt = [r for r in missing if r in v.refused]
        lost = [r for r in missing if r not in v.refused]
        why = []
        if corrupt:
            damage = f" ({'; '.join(v.damage[:2])})" if v.damage else ""
            why.append(f"every surviving copy of ranks {_few(corrupt)}'s shards failed "
                       f"verification{damage}")
        if lost:
            why.append(f"shards of ranks {_few(lost)} are on no surviving node")
        # Only where some item had a copy or a partial replica: a layout without copies (FSDP)
        # lost nothing more than the shard just named.
        copied = [r for r in missing if any(coverage.groups_of(r, v.copy_groups)) or r in v.holdings]
        if copied:  # copies or partial replicas hold some of their items, not all
            why.append("nor do copies of all their items: lost are "
                       + "; ".join(_lost_copies(v, r) for r in copied[:4]))
        return "; ".join(why)
    return None


def _surviving(v: _StepView) -> set[int]:
    """Owners whose whole shard (of the step's save, not refused) is on some surviving node."""
    return {r for r, nodes in v.owner_nodes.items() if nodes}


def _lost_copies(v: _StepView, owner: int) -> str:
    """Which of ``owner``'s items no surviving node holds, by copy group (for a reason)."""
    lost = [g for g in coverage.groups_of(owner, v.copy_groups)
            if not coverage.holders(owner, g, v.holdings)]
    return ", ".join(f"rank {owner}'s items with no copy" if not g else
                     f"rank {owner}'s items copied only to ranks {list(g)}" for g in lost[:3])


def _few(ranks: list[int]) -> list:
    return ranks[:8] + (["..."] if len(ranks) > 8 else [])


def _newest_protected(view: dict[int, _StepView], places: int) -> int | None:
    for step in sorted(view, reverse=True):
        v = view[step]
        if v.required is not None and coverage.protected(v.required, v.copy_groups, v.holdings,
                                                         places, v.meta_nodes):
            return step
    return None


def _fetch_plan(step: int, v: _StepView, nodes: list[NodeInventory], world_size: int,
                can_fetch: bool) -> Decision | None:
    """The decision to load ``step``: which nodes hold which items (``holders``, ``partial``),
    where each rank's own shard is (``sources``), and who fetches the metadata from whom. It
    picks no source for a shard: the reads are dealt over the holders where they are made."""
    node_ranks = {inv.node: inv.ranks for inv in nodes if inv.ranks}
    rank_node = {r: n for n, ranks in node_ranks.items() for r in ranks}
    d = Decision(MEMORY, step, resharded=v.world_size != world_size, save_id=v.save_id,
                 lineage=v.lineage, partial={o: dict(by_node) for o, by_node in v.partial.items()},
                 data_bytes=dict(v.data_bytes))
    d.holders = {o: [r for n in sorted(by_node) for r in node_ranks[n]] for o, by_node in v.holdings.items()}
    meta_nodes = sorted(set(v.meta_nodes))
    d.metadata_holders = [r for n in meta_nodes for r in node_ranks[n]]
    # The metadata is one small file, the same for every node lacking it: round robin over
    # the nodes holding it, and over each one's ranks. The node's first rank (its leader)
    # fetches it: the rank that then checks it, before any rank loads (``Recovery.run``).
    lacking = [(node, ranks) for node, ranks in sorted(node_ranks.items()) if node not in v.meta_nodes]
    for i, (node, ranks) in enumerate(lacking):
        src = node_ranks[meta_nodes[i % len(meta_nodes)]]
        d.fetches.append(Fetch(ranks[0], src[(i // len(meta_nodes) + 1) % len(src)], step))
    required = set(v.required or ())
    d.through_copies = sorted(required - _surviving(v))  # complete: their items survive
    for rank in sorted(rank_node):
        node = rank_node[rank]
        if d.resharded or rank not in required:
            d.sources[rank] = "local"
            continue
        if node in v.owner_nodes[rank]:
            d.sources[rank] = "local"
        elif rank in d.through_copies:  # no node to fetch its shard from: the reader reads copies
            d.sources[rank] = COPIES
            here = {o: {node: by_node[node]} for o, by_node in v.holdings.items() if node in by_node}
            if not can_fetch and coverage.unreadable([rank], v.copy_groups, here):
                return None  # some copies it needs are on other nodes only
        else:
            d.sources[rank] = "peer"
            if not can_fetch:
                return None  # its shard is on other nodes only
    if not can_fetch and d.fetches:
        return None
    return d

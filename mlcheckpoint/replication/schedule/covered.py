"""What replication sends of one rank's shard, partner by partner: only the items that lack
their places.

A data-parallel job holds each replicated item on several nodes, and a save can keep a copy of
it there (``dcp/copies.py``); the save's metadata records which ranks' shards hold agreeing
copies of each owner's items. ``store/coverage.py`` says, copy group by copy group, which of an
owner's items are on fewer than ``places`` places and which partner does not hold them yet;
those items alone go to that partner, as a partial replica at their own offsets
(``Manifest.only``). A shard whose every item lacks its places goes whole, as before copies
existed; one whose items all have them sends nothing. So a DDP job sends only its per-rank
entries (an RNG state, a data loader's position), and an FSDP job with one uncovered item only
that item. The room a node keeps for what arrives (``arriving_bytes``) asks the same rule.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...errors import MLCheckpointError
from ...integrity.verify import Listing
from ...store import LocalStore, coverage
from ...store.coverage import StepItems
from ...store.inventory import StepState
from ...store.manifest import Manifest, ManifestItem
from ...store.shards import align
from ...topology import Topology

# What one partner gets: None, the whole shard; [], nothing; else these items (a partial replica)
Push = list[ManifestItem] | None


def plan_push(m: Manifest, st: StepState, items: StepItems | None, save_id: str,
              topology: Topology, places: int, targets: Sequence[int]) -> dict[int, Push]:
    """Per partner rank in ``targets``, what to send of this rank's shard ``m`` of save
    ``save_id``, from the metadata of that save here (``st``, ``items``). Without it (rank 0
    sends it to every node before naming a round, ``Replicator._propose_next``), the whole
    shard goes to everyone."""
    whole: dict[int, Push] = dict.fromkeys(targets)
    if st.save_id != save_id or st.required_ranks is None or items is None:
        return whole
    owner, groups = m.rank, st.copy_groups
    holdings = _as_saved(owner, groups, topology)
    listing = Listing(m.items)
    out: dict[int, Push] = {}
    for peer in targets:
        need = coverage.to_send(owner, groups, holdings, places, topology.node_of(peer),
                                topology.place_of_node)
        locs = [loc for g in need for loc in items.of(owner, g)]
        if not listing.holds_all(locs):
            return whole  # the manifest and the metadata disagree: send what is certain
        chosen = [listing.listed(o) for o in sorted({loc.offset for loc in locs})]
        # (a rank that holds no item of its own, or none lacking places, sends nothing)
        out[peer] = None if len(chosen) == len(m.items) else chosen
    return out


def pushed_bytes(m: Manifest, push: Push) -> int:
    """The bytes ``push`` sends of shard ``m``."""
    return m.data_bytes if push is None else sum(it.nbytes for it in push)


def arriving_bytes(st: StepState, items: StepItems, topology: Topology, places: int,
                   sources: Sequence[int]) -> int:
    """The bytes the replicas of ``sources``' shards of the save ``st`` describes bring to
    this rank's node (the same rule their senders follow, ``plan_push``): what a node keeps
    room for beside its own shards."""
    total = 0
    for owner in sources:
        holdings = _as_saved(owner, st.copy_groups, topology)
        need = coverage.to_send(owner, st.copy_groups, holdings, places, topology.node_rank,
                                topology.place_of_node)
        total += sum(align(loc.nbytes) for g in need for loc in items.of(owner, g))
    return total


class Arrivals:
    """What the replicas of ``sources``' shards will bring to this rank's node with its next
    save, predicted from the newest save whose metadata is here (a job's saves keep their
    structure) by ``arriving_bytes``; None before any (the store then assumes whole shards).
    The store's room check asks it (``Capacity.expect_replicas``) when a save needs new room."""

    def __init__(self, store: LocalStore, topology: Topology, places: int, sources: Sequence[int]):
        self.store, self.topology, self.places, self.sources = store, topology, places, list(sources)
        self._known: tuple[str, int] | None = None  # (save id, bytes) of the last prediction

    def __call__(self) -> int | None:
        for step in sorted(self.store.steps(), reverse=True):
            st = self.store.step_state(step)
            if st.save_id is None:
                continue
            if self._known is not None and self._known[0] == st.save_id:
                return self._known[1]
            try:
                items = self.store.step_items(step)
            except MLCheckpointError:
                return None
            nbytes = arriving_bytes(st, items, self.topology, self.places, self.sources)
            self._known = (st.save_id, nbytes)
            return nbytes
        return None


def _as_saved(owner: int, groups: coverage.CopyGroups, topology: Topology) -> dict:
    """Where the owner's items are before any replica: its own shard, and the shards of the
    ranks keeping copies of them, each on its rank's node."""
    ranks = {owner, *(r for g in coverage.groups_of(owner, groups) for r in g)}
    return coverage.as_saved({r: topology.node_of(r) for r in ranks})

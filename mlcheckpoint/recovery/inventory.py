"""What each node holds, as reported at job start (one collective gathers these)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..store import LocalStore
from ..store.coverage import WHOLE, Held
from ..store.identity import Lineage
from ..store.inventory import StepState


@dataclass(frozen=True)
class StepCopy:
    """One node's holdings of one step."""

    owners: frozenset[int]  # ranks whose committed shard is here
    has_metadata: bool
    required: tuple[int, ...] | None = None  # ranks the step needs (from the metadata header)
    world_size: int | None = None  # world size when the step was saved
    shard_bytes: tuple[tuple[int, int], ...] = ()  # (owner, bytes): Decision.data_bytes
    # Which save the metadata here describes, by which run, descending from which runs, when.
    save_id: str = ""
    run_id: str = ""
    ancestors: tuple[tuple[str, int], ...] = ()
    created: float = 0.0
    shard_saves: tuple[tuple[int, str], ...] = ()  # (owner, save id of its shard here)
    damaged: tuple[tuple[int, str], ...] = ()  # (owner, why) for unusable shard copies here
    # owner -> the sets of ranks whose shards hold copies of its items (``store/coverage.py``)
    copy_groups: tuple[tuple[int, tuple[tuple[int, ...], ...]], ...] = ()
    # (owner, what it holds) for each owner whose shard here is a partial replica (only the
    # items that lacked places were sent): the items it serves, and the copy groups they make
    # whole (``coverage.Held``, one look at its manifest); a shard not named is whole
    partial: tuple[tuple[int, Held], ...] = ()

    def copies(self) -> dict[int, tuple[tuple[int, ...], ...]]:
        """The copy groups, keyed by owner rank."""
        return dict(self.copy_groups)

    def held(self, owner: int) -> Held:
        """What this node holds of ``owner``'s shard (``coverage.Held``): all of it, or what a
        partial replica holds."""
        return dict(self.partial).get(owner, WHOLE)

    def save_of(self, owner: int) -> str:
        """The save id of ``owner``'s shard here ("" when unrecorded)."""
        return dict(self.shard_saves).get(owner, "")

    @property
    def lineage(self) -> Lineage:
        return Lineage(self.run_id, self.ancestors)


@dataclass
class NodeInventory:
    node: int
    ranks: list[int]  # current ranks on this node (any of them can serve its store)
    steps: dict[int, StepCopy] = field(default_factory=dict)


def take_inventory(store: LocalStore, node: int, ranks: list[int],
                   listed: Mapping[int, StepState] | None = None) -> NodeInventory:
    """List committed shards and valid metadata of this job's store (no checksums computed;
    a shard whose manifest is unreadable or whose data file is short is not listed).
    ``listed``: the store's ``inventory.all()`` when the caller has just taken it."""
    inv = NodeInventory(node=node, ranks=list(ranks))
    for step, st in (store.inventory.all() if listed is None else listed).items():
        sizes = []
        for owner in sorted(st.committed_ranks):
            try:
                sizes.append((owner, os.stat(store.paths.data(step, owner)).st_size))
            except FileNotFoundError:
                continue
        copy = StepCopy(
            owners=frozenset(o for o, _ in sizes), has_metadata=st.has_metadata,
            required=tuple(st.required_ranks) if st.required_ranks is not None else None,
            world_size=st.world_size, shard_bytes=tuple(sizes),
            shard_saves=tuple((o, st.shard_saves[o]) for o, _ in sizes),
            damaged=tuple(sorted(st.damaged.items())),
            partial=tuple((o, st.partial[o]) for o, _ in sizes if o in st.partial))
        h = st.header
        if h is not None:  # the metadata here names its save, its run and the runs before it
            copy = dataclasses.replace(copy, save_id=h.save_id, run_id=h.run_id, created=h.created,
                                       ancestors=Lineage.from_header(h.run_id, h.lineage).ancestors,
                                       copy_groups=tuple((owner, tuple(gs))
                                                         for owner, gs in sorted(st.copy_groups.items())))
        inv.steps[step] = copy
    return inv


"""What this node holds of each step: committed shards (and whose save), metadata, damage."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from .._messages import RateLimitedLog
from ..errors import CorruptShardError, MLCheckpointError, ShardNotFoundError
from ..topology import Topology
from . import coverage
from .identity import Lineage
from .layout import JobPaths, Kind, classify
from .manifest import ManifestItem
from .metadata import MetadataFiles
from .shards import ShardFiles

log = logging.getLogger(__name__)
# Listings run every few hundred ms (the replicator polls): say so about a damaged copy now and
# then, not each time.
_damage_log = RateLimitedLog(log, interval=300.0)


@dataclass
class StepState:
    """What this node holds of one step: the one record of it, for the store's own checks,
    the replicator, listings and (gathered from every node at job start) the recovery planner."""

    step: int
    has_metadata: bool = False
    committed_ranks: set[int] = field(default_factory=set)
    # From the metadata's verified header, when present: the ranks the step needs (a tuple: a
    # resume gathers every node's listing, and the planner of a large job holds thousands of
    # these, which the garbage collector then need not walk), the save it describes, the run
    # that made it, when (its coordinator's clock), the runs it descends from, each node's
    # copies mode.
    required_ranks: tuple[int, ...] | None = None
    world_size: int | None = None
    total_bytes: int | None = None
    save_id: str | None = None
    run_id: str = ""
    created: float = 0.0
    ancestors: tuple[tuple[str, int], ...] = ()
    copy_modes: tuple[str, ...] = ()
    shard_saves: dict[int, str] = field(default_factory=dict)  # owner -> save id of its shard
    damaged: dict[int, str] = field(default_factory=dict)  # owner -> why its copy is unusable
    # owner -> which other ranks' shards hold copies of its items (``StepItems.groups``, from
    # the metadata here)
    copy_groups: dict[int, list[coverage.Group]] = field(default_factory=dict)
    # owner -> what its partial replica here holds (``coverage.Held``: the items it lists as
    # the metadata here records them, and the copy groups they make whole); an owner whose
    # committed shard here is whole is not listed
    partial: dict[int, coverage.Held] = field(default_factory=dict)
    shard_bytes: dict[int, int] = field(default_factory=dict)  # owner -> its data file's bytes

    @property
    def lineage(self) -> Lineage:
        """The save's run and the runs it descends from."""
        return Lineage(self.run_id, self.ancestors)

    def ranks_of(self, save_id: str | None) -> set[int]:
        """Owners whose committed shard here belongs to the save ``save_id``."""
        return {r for r in self.committed_ranks if self.shard_saves.get(r) == save_id}


    def holdings(self, place: object = "here") -> dict[int, dict[object, coverage.Held]]:
        """What this node (as ``place``) holds of each owner's shard of the save the metadata
        here describes (``coverage.Holdings``): whole, or a partial replica's groups."""
        return {r: {place: self.partial.get(r, coverage.WHOLE)} for r in self.ranks_of(self.save_id)}

    @property
    def complete(self) -> bool:
        """Metadata and every item of that same save are committed here: in its owner's
        shard, a partial replica listing it, or a shard holding a data-parallel copy of it."""
        return (self.has_metadata and self.required_ranks is not None
                and not coverage.unreadable(self.required_ranks, self.copy_groups,
                                            self.holdings()))


class Inventory:
    """Lists the steps of one job on this node and what each holds."""

    def __init__(self, paths: JobPaths, shards: ShardFiles, metadata: MetadataFiles):
        self.paths, self.shards, self.metadata = paths, shards, metadata
        # manifest path -> (its version, save id, data bytes, a partial replica's items or None)
        self._manifest_ids: dict[str, tuple[tuple, str, int, tuple[ManifestItem, ...] | None]] = {}

    def steps(self) -> list[int]:
        return self.paths.step_numbers()

    def step_state(self, step: int) -> StepState:
        st = StepState(step)
        try:
            entries = [classify(n) for n in os.listdir(self.paths.step_dir(step))]
        except FileNotFoundError:
            return st
        partial_items: dict[int, tuple[ManifestItem, ...]] = {}
        for entry in entries:
            r = entry.rank
            if entry.kind is Kind.MANIFEST and r is not None:
                try:
                    st.shard_saves[r], st.shard_bytes[r], listed = self._manifest_identity(step, r)
                except ShardNotFoundError:
                    continue  # retired between the listing and the read
                except CorruptShardError as e:
                    st.damaged[r] = str(e)
                    _damage_log.warning(self.paths.manifest(step, r), "ignoring step %d rank %d "
                                        "here: %s", step, r, e)
                    continue
                st.committed_ranks.add(r)
                if listed is not None:
                    partial_items[r] = listed
        if any(entry.kind is Kind.METADATA for entry in entries):
            try:
                header = self.metadata.header(step)
            except ShardNotFoundError:
                pass  # retired between the listing and the read
            except CorruptShardError as e:
                log.warning("ignoring metadata of step %d: %s", step, e)
            else:
                st.has_metadata = True
                st.required_ranks = tuple(header.ranks)
                st.world_size = header.world_size
                st.total_bytes = header.total_bytes
                st.save_id, st.run_id, st.created = header.save_id, header.run_id, header.created
                st.ancestors = Lineage.from_header(header.run_id, header.lineage).ancestors
                st.copy_modes = tuple(header.copy_modes)
                with contextlib.suppress(ShardNotFoundError, CorruptShardError):
                    st.copy_groups = self.metadata.copy_groups(step)
        for r, listed in partial_items.items():
            st.partial[r] = self._held(step, r, listed, st)
        return st

    def _held(self, step: int, owner: int, listed: tuple[ManifestItem, ...],
              st: StepState) -> coverage.Held:
        """What a partial replica of ``owner`` here holds, by the step's metadata here
        (nothing without it, or when it names another save: nothing is counted, or read,
        that cannot be checked)."""
        if st.save_id is None or st.shard_saves.get(owner) != st.save_id:
            return coverage.Held(frozenset())
        try:
            items = self.metadata.items(step)
        except (ShardNotFoundError, CorruptShardError):
            return coverage.Held(frozenset())
        return items.held(owner, listed)

    def _manifest_identity(self, step: int, rank: int) -> tuple[str, int, tuple[ManifestItem, ...] | None]:
        """The save id a committed shard's manifest names, once its data file is checked whole,
        its data file's bytes, and, for a partial replica, the items its manifest lists (None:
        a whole shard).

        Cached per manifest version like metadata headers: the replicator lists often. A
        shard whose manifest is unreadable or whose data file is missing or short raises
        CorruptShardError, so it is never counted as held.
        """
        path = self.paths.manifest(step, rank)
        data = self.paths.data(step, rank)
        try:
            st = os.stat(path)
            data_size = os.stat(data).st_size
        except FileNotFoundError:
            if os.path.exists(path):
                raise CorruptShardError(f"{data} is missing though its manifest is committed") from None
            raise ShardNotFoundError(f"step {step} rank {rank} is not committed here") from None
        version = (st.st_ino, st.st_size, st.st_mtime_ns)
        cached = self._manifest_ids.get(path)
        if cached is None or cached[0] != version:
            m = self.shards.read_manifest(step, rank)
            cached = self._manifest_ids[path] = (version, m.save_id, m.data_bytes,
                                                 tuple(m.items) if m.partial else None)
        if data_size < cached[2]:
            raise CorruptShardError(f"{data} is truncated: {data_size} of {cached[2]} bytes")
        return cached[1], data_size, cached[3]

    def all(self) -> dict[int, StepState]:
        return {s: self.step_state(s) for s in self.steps()}

    def complete_steps(self) -> list[int]:
        """Steps whose metadata and every needed shard are committed here, oldest first."""
        return [s for s, st in self.all().items() if st.complete]


class Arrivals:
    """What the replicas of ``sources``' shards will bring to this rank's node with its next
    save, predicted from the newest save whose metadata is here (a job's saves keep their
    structure) by ``coverage.arriving_bytes``; None before any (the store then assumes whole
    shards). The store's room check asks it (``Capacity.expect_replicas``) when a save needs new
    room."""

    def __init__(self, inventory: Inventory, metadata: MetadataFiles, topology: Topology,
                 places: int, sources: Sequence[int]):
        self.inventory, self.metadata = inventory, metadata
        self.topology, self.places, self.sources = topology, places, list(sources)
        self._known: tuple[str, int] | None = None  # (save id, bytes) of the last prediction

    def __call__(self) -> int | None:
        for step in sorted(self.inventory.steps(), reverse=True):
            st = self.inventory.step_state(step)
            save_id = st.save_id
            if save_id is None:
                continue
            if self._known is not None and self._known[0] == save_id:
                return self._known[1]
            try:
                items = self.metadata.items(step)
            except MLCheckpointError:
                return None
            t = self.topology
            nbytes = coverage.arriving_bytes(items, {t.node_rank: self.sources}, t.node_of,
                                             self.places, t.place_of_node)[t.node_rank]
            self._known = (save_id, nbytes)
            return nbytes
        return None

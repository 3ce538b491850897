"""Reads from other nodes during one resume attempt, and the rebuild of a replaced node's shard.

Every read of bytes this node lacks goes through ``Holders``: the byte ranges the reader
streams into the model (``nodes_holding`` and ``read_runs``, the ``dcp.remote.RemoteReads``
protocol: the reader deals each item to one of the nodes that hold any of its places,
``dcp/remote.py``), the step's metadata for a node without it (``fetch_metadata``), and, after
the load, a replaced node's own rank's shard (``rebuild``), assembled item by item from the
places that hold them: a whole shard on another node is the case where every item is there.
Which node serves an item is decided by ``dcp/remote.py`` ``deal`` alone; the metadata, one
small file, comes from the source the plan names. Which rank of a node to ask, and in what
order, is decided in one place: ``holder_order``.

The resume waits for the first two, so the holder sends them at the link's full speed; the
rebuild runs in the background and is paced by the holder's bandwidth budget (``paced``).
Once the shard is back, the replicator's ordinary rounds protect the step again: each rank
pushes its partners what lacks places (``store/coverage.py`` ``plan_push``), as after a save.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable

import numpy as np

from .._faults import crash_point
from .._messages import plural
from ..dcp.placement import recorded_items
from ..dcp.remote import RemoteRun, fetch_items
from ..errors import CopyId, CorruptShardError, MLCheckpointError, ShardNotFoundError
from ..integrity.verify import digests_agree, integrity_error
from ..replication.core.streams import run_streams
from ..replication.core.transport import Transport
from ..store import LocalStore
from ..store.layout import ItemLocation
from ..store.manifest import Manifest, ManifestItem, dcp_metadata
from ..topology import Topology
from .planner import Decision

log = logging.getLogger(__name__)


def holder_order(plan: Decision, topology: Topology, owner: int | None) -> list[int]:
    """Ranks on other nodes to ask for ``owner``'s shard (None: the metadata), in order: for
    the metadata, the source the plan named for this node (``Decision.fetches``) first; then
    every holder, starting at an offset set by this rank so that the readers of one node
    spread over the holders' ranks. A pure function of the plan and who asks: it orders the
    ranks of the nodes a read may go to, it never picks the node (``remote.deal`` does)."""
    node_of = topology.node_of
    here = topology.node_rank
    held = plan.metadata_holders if owner is None else plan.holders.get(owner, [])
    others = [r for r in held if node_of(r) != here]
    start = topology.rank % len(others) if others else 0
    order = others[start:] + others[:start]
    if owner is None:
        order = [f.src_rank for f in plan.fetches if node_of(f.dst_rank) == here] + order
    return list(dict.fromkeys(order))


class Holders:
    """The nodes that hold the step ``plan`` loads, seen from this rank.

    One per resume attempt (a plan names its step, save and holders). ``bytes_fetched``
    counts the shard bytes read from peers for the load, ``bytes_served`` the same per shard
    (its owner rank) and node they came from (how the reads spread over the holders).
    """

    def __init__(self, transport: Transport, store: LocalStore, topology: Topology, plan: Decision):
        assert plan.step is not None, "holders serve a step loaded from memory"
        self.transport, self.store, self.topo, self.plan = transport, store, topology, plan
        self.step: int = plan.step
        self.bytes_served: dict[int, dict[int, int]] = {}  # owner -> node -> bytes
        self._holder_nodes: dict[int, list[int]] = {}  # owner -> other nodes holding its shard
        # (rank, node): that node's copy of rank's shard served an item the rebuild found
        # corrupt; asked nothing more
        self._refused: set[tuple[int, int]] = set()

    @property
    def bytes_fetched(self) -> int:
        return sum(n for by_node in self.bytes_served.values() for n in by_node.values())

    def nodes_holding(self, step: int, owner: int, offset: int) -> list[int]:
        """The other nodes whose copy of ``owner``'s shard holds the item at ``offset``
        (``RemoteReads``): every node holding the shard, a partial replica only for the items
        it lists; from an offset set by this rank's place on its node, so that the readers of
        one node begin on different holders."""
        self._check_step(step)
        if owner not in self._holder_nodes:
            nodes = sorted({self.topo.node_of(r) for r in self.plan.holders.get(owner, ())}
                           - {self.topo.node_rank})
            start = self.topo.local_rank % len(nodes) if nodes else 0
            self._holder_nodes[owner] = nodes[start:] + nodes[:start]
        partial = self.plan.partial.get(owner, {})
        return [n for n in self._holder_nodes[owner] if (n not in partial or offset in partial[n])
                and (owner, n) not in self._refused]

    def read_runs(self, step: int, runs: list[RemoteRun], on_range: Callable[[int, int], None],
                  *, paced: bool = False) -> list[BaseException | None]:
        """Read each run from the ranks of its node that hold its shard, one after the other
        until one serves it; the nodes at once, each node's runs in turn (``RemoteReads``).
        Nothing lands in this node's store (see ``rebuild``). A node that failed otherwise
        than by lacking a shard (dead, unreachable) is asked nothing more: its other runs
        fail with the same error. ``bytes_served`` counts the load's reads, not the paced
        ones of a rebuild."""
        self._check_step(step)
        errors: list[BaseException | None] = [None] * len(runs)
        by_node: dict[int, list[int]] = {}
        for i, run in enumerate(runs):
            by_node.setdefault(run.node, []).append(i)
        lock = threading.Lock()

        def read_node(indices: list[int]) -> None:
            down: BaseException | None = None
            for i in indices:
                run = runs[i]
                if down is not None:
                    errors[i] = down
                    continue
                try:
                    nbytes = self._read_run(step, run, functools.partial(on_range, i), paced)
                except ShardNotFoundError as e:
                    errors[i] = e
                    continue
                except (MLCheckpointError, OSError) as e:
                    errors[i] = down = e
                    continue
                if paced:
                    continue
                with lock:
                    served = self.bytes_served.setdefault(run.owner, {})
                    served[run.node] = served.get(run.node, 0) + nbytes

        failed = run_streams(read_node, list(by_node.values()))  # returns once no read writes
        if failed:
            raise failed[0]  # not a read's failure (those are in ``errors``): a bug
        nodes = sorted({run.node for run, error in zip(runs, errors, strict=True) if error is None})
        log.debug("mlcheckpoint: read %s of step %d from %s %s",  # ResumeInfo.labels say it
                 plural(sum(len(run.ranges) for run in runs), "item"), step,
                 "node" if len(nodes) == 1 else "nodes", nodes)
        return errors

    def _read_run(self, step: int, run: RemoteRun, on_range: Callable[[int], None],
                  paced: bool) -> int:
        """``run`` from the first rank of its node that serves it; returns its bytes. Raises
        ShardNotFoundError when every one answered that it lacks the shard, else the error
        of the last that failed otherwise."""
        ranks = [r for r in holder_order(self.plan, self.topo, run.owner) if self.topo.node_of(r) == run.node]
        lacking: BaseException = ShardNotFoundError(
            f"node {run.node} holds no copy of rank {run.owner}'s shard of step {step}")
        failed: BaseException | None = None
        for src in ranks:
            try:
                return self.transport.read_items(src, step, run.owner, run.ranges, run.sinks,
                                                 on_range, paced=paced)
            except ShardNotFoundError as e:
                lacking = e
            except (MLCheckpointError, OSError) as e:
                failed = e
        raise failed if failed is not None else lacking

    def fetch_metadata(self) -> None:
        """Pull the step's global metadata into this node's store, from the first holder that
        serves it (``holder_order``: the plan's source for this node first)."""
        errors = []
        with self.store.fetch_lock(self.step, None):
            for src in holder_order(self.plan, self.topo, None):
                try:
                    self.transport.fetch_metadata(src, self.step, paced=False)
                except (MLCheckpointError, OSError) as e:
                    errors.append(f"rank {src}: {e}")
                    continue
                log.debug("mlcheckpoint: fetched the metadata of step %d from rank %d", self.step, src)
                return
        raise ShardNotFoundError(f"no holder could serve the metadata of step {self.step}: "
                                 f"{errors or 'no other node holds it'}")

    def rebuild(self, owner: int) -> bool:
        """Put ``owner``'s shard of the step back into this node's store as its save left it
        (the same save, items, offsets and checksums), verified and committed, so that
        replication protects the step again (a replaced node's own shard, after the load).

        Each item the step's metadata records in the shard (its primaries, the copies it keeps
        of other ranks' items) is read from a node holding any place of it (``fetch_items``:
        dealt over the holders, paced by their budgets; a whole copy of the shard on another
        node is a place of every item, a partial replica of those it lists, a copy data
        parallelism kept of one), verified against the recorded checksum, and committed under
        the manifest its save wrote (its size taken from a copy on a survivor,
        ``Decision.data_bytes``). An item whose bytes disagree with its checksum is read again
        from another place, the copy that served it asked nothing more; CorruptShardError
        once no good place is left. Returns False when the shard is here already."""
        with self.store.fetch_lock(self.step, owner):
            st = self.store.inventory.step_state(self.step)
            if owner in st.ranks_of(self.plan.save_id) and owner not in st.partial:
                return False
            header, payload = self.store.metadata.read(self.step, self.plan.save_id)
            items = recorded_items(dcp_metadata(payload), owner)
            if not items:
                raise ShardNotFoundError(f"the metadata of step {self.step} records no item of "
                                         f"rank {owner}'s shard")
            end = max(it.offset + it.nbytes for it, _ in items)
            m = Manifest(job_id=self.store.job_id, step=self.step, rank=owner,
                         data_bytes=max(end, self.plan.data_bytes.get(owner, 0)),
                         items=[it for it, _ in items], world_size=header.world_size,
                         created=header.created, save_id=header.save_id, run_id=header.run_id)
            shard = self.store.begin_shard(self.step, owner, m.data_bytes)
            try:
                nodes = self._read_verified(owner, items, shard.buffer.array)
                shard.commit_manifest(m)
            finally:
                # (nothing once committed) The step's metadata stays: this node fetched it to
                # load the step, and its other ranks may be rebuilding theirs with it.
                shard.abort(keep_metadata=True)
        log.info("mlcheckpoint: rebuilt rank %d's shard of step %d (%d bytes) from %s %s", owner,
                 self.step, sum(it.nbytes for it, _ in items), "node" if len(nodes) == 1 else "nodes",
                 ", ".join(map(str, nodes)))
        return True

    def _read_verified(self, owner: int, items: list[tuple[ManifestItem, ItemLocation]],
                       data: np.ndarray) -> list[int]:
        """Fill ``data`` (``owner``'s shard) with each item, read from the places that hold it
        and checked against its recorded checksum; an item that fails is read again from the
        places left. Returns the nodes the bytes came from. Items are told apart by their
        position in ``items``, not their offset: an empty item shares the next one's."""
        sinks = {i: data[it.offset:it.offset + it.nbytes] for i, (it, _) in enumerate(items)}
        pending = {i: loc for i, (it, loc) in enumerate(items) if it.nbytes}  # (empty: no read)
        served: set[int] = set()
        corrupt: CorruptShardError | None = None
        while pending:
            try:
                came = fetch_items(self, self.step, pending, sinks, lambda i: (
                    f"no place of the item at offset {items[i][0].offset} of rank {owner}'s "
                    "shard is"), paced=True)
            except ShardNotFoundError as e:
                if corrupt is None:
                    raise
                raise corrupt from e  # every place left of an item served it corrupt
            crash_point("rebuild_before_commit", self.step, owner)  # tests: bytes landed
            bad = {}
            for i, (rank, node, digest) in sorted(came.items()):
                if digests_agree(pending[i].checksum, digest.result()[0]):
                    served.add(node)
                    continue
                corrupt = integrity_error(f"step {self.step} rank {rank}'s shard on node {node}",
                                          f"the item rebuilding rank {owner}'s shard at offset "
                                          f"{items[i][0].offset}", CopyId(self.step, rank, node))
                log.warning("mlcheckpoint: %s; reading it from another place", corrupt)
                self._refused.add((rank, node))
                bad[i] = pending[i]
            pending = bad
        return sorted(served)

    def _check_step(self, step: int) -> None:
        if step != self.step:
            raise ShardNotFoundError(f"asked for step {step} while loading step {self.step}")

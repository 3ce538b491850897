"""Which shards replication need not send: data parallelism keeps their items elsewhere.

A data-parallel job holds each replicated item on several nodes, and a save can keep a copy of
it there (``dcp/copies.py``); the save's metadata records which ranks' shards hold agreeing
copies of each owner's items (``MetadataHeader.copy_groups``). An owner's shard whose every
item is on ``copies`` places that way counts as replicated without a byte sent. Shard by
shard: one item without copies enough and the whole shard is sent.
"""

from __future__ import annotations

from ...store import coverage
from ...store.inventory import StepState
from ...topology import Topology


def shard_covered(st: StepState, save_id: str, topology: Topology, copies: int) -> bool:
    """Whether the metadata of save ``save_id`` here (``st``) says every item of this rank's
    shard is on ``copies`` places (its node and the nodes of ranks that kept agreeing copies;
    a place is a failure domain where declared). False without that metadata here: rank 0
    sends it to every node before naming a round (``Replicator._propose_next``)."""
    if st.save_id != save_id or st.required_ranks is None:
        return False
    # (a rank DCP gave no item has no copy groups: its shard, copies only if anything, is
    # sent as before; recovery may still want it)
    return coverage.fewest_places(topology.rank, st.copy_groups,
                                  lambda r: {topology.place_of_rank(r)}) >= copies

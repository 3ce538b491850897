"""replication/schedule/covered.py: which shards need no sending, from a save's copy groups (pure)."""

from __future__ import annotations

from mlcheckpoint.replication.schedule.covered import shard_covered
from mlcheckpoint.store.inventory import StepState
from mlcheckpoint.store.manifest import MetadataHeader
from mlcheckpoint.topology import Topology


def state(copy_groups: dict[str, list[list[int]]], save_id: str = "s1") -> StepState:
    header = MetadataHeader(job_id="j", step=3, world_size=4, ranks=[0, 1, 2, 3], total_bytes=0,
                            payload_bytes=0, checksum=0, save_id=save_id, copy_groups=copy_groups)
    return StepState(3, has_metadata=True, required_ranks=header.ranks, world_size=4,
                     header=header)


def topo(rank: int, domains: tuple[str, ...] = ()) -> Topology:
    # 4 nodes x 1 rank
    return Topology(rank=rank, world_size=4, local_world_size=1, node_rank=rank, num_nodes=4,
                    domains=domains)


def test_items_copied_on_another_node_need_no_sending():
    st = state({"0": [[1]], "1": [[0]]})
    assert shard_covered(st, "s1", topo(0), copies=2)
    assert shard_covered(st, "s1", topo(1), copies=2)
    assert not shard_covered(st, "s1", topo(2), copies=2)  # no copies of rank 2's items
    assert not shard_covered(st, "s1", topo(0), copies=3)  # two places, three wanted


def test_one_item_without_a_copy_sends_the_whole_shard():
    st = state({"0": [[], [1]]})  # some of rank 0's items have no copy
    assert not shard_covered(st, "s1", topo(0), copies=2)


def test_a_copy_in_the_same_failure_domain_adds_no_place():
    st = state({"0": [[1]], "2": [[3]]})
    domains = ("rack-a", "rack-a", "rack-b", "rack-c")
    assert not shard_covered(st, "s1", topo(0, domains), copies=2)
    assert shard_covered(st, "s1", topo(2, domains), copies=2)


def test_another_save_or_no_metadata_here_is_never_covered():
    st = state({"0": [[1]]})
    assert not shard_covered(st, "other", topo(0), copies=2)
    assert not shard_covered(StepState(3), "s1", topo(0), copies=2)

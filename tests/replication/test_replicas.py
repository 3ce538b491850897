"""More than one partner (``replicas`` = k): the pairing, property-tested; what a resume makes
of it (losing any k nodes resumes from memory, reads spread over the holders); protection
counting k + 1 copies; the capacity preflight counting the replicas that arrive with a save.

The multi-node part (real processes) is tests/jobs/test_replicas_jobs.py.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from helpers import held_step
from hypothesis import given
from hypothesis import strategies as st

from mlcheckpoint import CapacityError
from mlcheckpoint.dcp.remote import deal
from mlcheckpoint.errors import ConfigError
from mlcheckpoint.recovery import NodeInventory, plan_resume
from mlcheckpoint.recovery.holders import Holders
from mlcheckpoint.recovery.planner import MEMORY
from mlcheckpoint.replication.schedule.pairing import (
    DomainPairing,
    PairwiseRing,
    ReplicaPairing,
    pairing_for,
    rank_sources,
    rank_targets,
    replica_targets,
)
from mlcheckpoint.settings import ReplicationOptions
from mlcheckpoint.store import LocalStore
from mlcheckpoint.topology import Topology

JOB = "job-replicas"
MiB = 1 << 20
# Up to 16 nodes in up to 6 domains; "" is a node that names no domain.
DOMAINS = st.lists(st.sampled_from(["", "r0", "r1", "r2", "r3", "r4", "r5"]), min_size=1,
                   max_size=16)


def alone(domains: list[str]) -> list[str]:
    """Each node's effective domain: one that names none shares it with nobody."""
    return [d or f"node{i}" for i, d in enumerate(domains)]


# ---------------------------------------------------------------------------- the pairing
@given(DOMAINS, st.integers(1, 5))
def test_k_distinct_partners_and_every_node_keeps_k_others(domains, replicas):
    n = len(domains)
    k = min(replicas, n - 1)
    targets = replica_targets(domains, replicas)
    for node, partners in enumerate(targets):
        assert len(partners) == len(set(partners)) == k, (domains, targets)
        assert node not in partners
    received = Counter(t for partners in targets for t in partners)
    assert all(received[node] == k for node in range(n)), (domains, targets)  # balanced


@given(DOMAINS, st.integers(1, 4))
def test_losing_any_k_nodes_keeps_a_copy_of_every_nodes_data(domains, replicas):
    targets = replica_targets(domains, replicas)
    n = len(domains)
    k = min(replicas, n - 1)
    for lost in itertools.combinations(range(n), k):
        assert all({node, *targets[node]} - set(lost) for node in range(n)), (domains, lost)


@given(st.integers(3, 6), st.integers(1, 4), st.integers(2, 5))
def test_domains_of_equal_size_put_every_copy_in_another_domain(racks, per_rack, replicas):
    domains = [f"rack{i // per_rack}" for i in range(racks * per_rack)]
    if replicas >= racks:
        return  # not enough domains for k + 1 distinct ones
    for node, partners in enumerate(replica_targets(domains, replicas)):
        held_in = [domains[node]] + [domains[t] for t in partners]
        assert len(set(held_in)) == replicas + 1, (domains, node, partners)


def test_without_domains_partners_are_spread_evenly_round_the_ring():
    # 6 nodes, k = 2: the nodes 2 and 4 places on (a third of the ring apart)
    assert replica_targets([""] * 6, 2) == [[(n + 2) % 6, (n + 4) % 6] for n in range(6)]
    assert replica_targets([""] * 8, 3) == [[(n + 2) % 8, (n + 4) % 8, (n + 6) % 8]
                                            for n in range(8)]


def test_pairing_for_keeps_todays_pairs_at_one_replica():
    assert isinstance(pairing_for(["", "", "", ""]), PairwiseRing)
    assert isinstance(pairing_for(["a", "b"], 1), DomainPairing)
    assert isinstance(pairing_for(["", "", "", ""], 2), ReplicaPairing)
    assert ReplicaPairing(["", ""], 3).targets(0, 2) == [1]  # as many as there are other nodes
    with pytest.raises(ValueError):
        ReplicaPairing(["", "", ""], 2).targets(0, 4)


@given(DOMAINS, st.integers(1, 3), st.integers(2, 3))
def test_rank_pairing_follows_node_pairing(domains, local_world, replicas):
    strategy = pairing_for(domains, replicas)
    n = len(domains)
    k = min(replicas, n - 1)
    for rank in range(n * local_world):
        node, local = divmod(rank, local_world)
        ranks = rank_targets(strategy, rank, local_world, n)
        assert [t // local_world for t in ranks] == strategy.targets(node, n)
        assert all(t % local_world == local for t in ranks)
        assert len(rank_sources(strategy, rank, local_world, n)) == k


def test_the_setting_is_a_whole_number_from_1_to_8(clean_env):
    assert ReplicationOptions().resolved().replicas == 1
    clean_env.setenv("MLCHECKPOINT_REPLICAS", "3")
    assert ReplicationOptions().resolved().replicas == 3
    assert ReplicationOptions(replicas=2).resolved().replicas == 2
    for bad in (0, 9, True, "2"):
        with pytest.raises(ConfigError, match="replicas"):
            ReplicationOptions(replicas=bad)


# ---------------------------------------------------------------------------- resuming
def replicated(nnodes: int, rpn: int, replicas: int, *, lost=()) -> list[NodeInventory]:
    """Step 5 saved by ``nnodes`` x ``rpn`` ranks and pushed to each node's ``replicas``
    partners, metadata everywhere; ``lost`` nodes came back empty."""
    world = nnodes * rpn
    targets = replica_targets([""] * nnodes, replicas)
    held: dict[int, set[int]] = {n: set(range(n * rpn, (n + 1) * rpn)) for n in range(nnodes)}
    for node, partners in enumerate(targets):
        for t in partners:
            held[t] |= set(range(node * rpn, (node + 1) * rpn))
    return [NodeInventory(n, list(range(n * rpn, (n + 1) * rpn)),
                          {} if n in lost else {5: held_step(
                              held[n], required=range(world), world_size=world,
                              shard_bytes=dict.fromkeys(held[n], 100))})
            for n in range(nnodes)]


@given(st.integers(3, 7), st.integers(1, 2), st.data())
def test_with_two_replicas_losing_any_two_nodes_resumes_from_memory(nnodes, rpn, data):
    lost = data.draw(st.sets(st.integers(0, nnodes - 1), min_size=2, max_size=2))
    d = plan_resume(replicated(nnodes, rpn, 2, lost=lost), None, nnodes * rpn, places=3)
    assert d.kind == MEMORY and d.step == 5, (lost, d.reason)
    assert sorted(r for r, s in d.sources.items() if s == "peer") == sorted(
        r for n in lost for r in range(n * rpn, (n + 1) * rpn))


def test_with_one_replica_losing_a_node_and_its_partner_does_not():
    d = plan_resume(replicated(4, 1, 1, lost={0, 2}), None, 4)  # 0 <-> 2: farthest on the ring
    assert d.kind != MEMORY


def test_protected_counts_the_configured_copies():
    nodes = replicated(4, 1, 2)
    assert plan_resume(nodes, None, 4, places=3).newest_protected == 5
    assert plan_resume(nodes, None, 4, places=4).newest_protected is None
    one = replicated(4, 1, 1)
    assert plan_resume(one, None, 4, places=2).newest_protected == 5
    assert plan_resume(one, None, 4, places=3).newest_protected is None


def test_a_replaced_nodes_reads_spread_over_both_holders():
    # 4 nodes, k = 2, node 0 replaced: its shard is on its two partners, and its reads are
    # dealt over both.
    partners = sorted(replica_targets([""] * 4, 2)[0])
    d = plan_resume(replicated(4, 1, 2, lost={0}), None, 4, places=3)
    here = Topology(rank=0, world_size=4, local_rank=0, local_world_size=1, node_rank=0,
                    num_nodes=4)
    holders = Holders(None, None, here, d)  # type: ignore[arg-type]  # asked, never reads
    nodes = holders.nodes_holding(d.step, 0, 0)
    assert sorted(nodes) == partners
    dealt = deal([(10, [((0, i * 10), nodes)]) for i in range(6)])
    assert Counter(node for _, node in dealt) == dict.fromkeys(partners, 3), dealt


# ---------------------------------------------------------------------------- capacity
def test_a_save_checks_room_for_the_replicas_that_arrive_with_it(store_dir):
    store = LocalStore(store_dir, JOB, memory_limit_bytes=8 * MiB)
    try:
        store.capacity.expect_replicas([0, 1], 2)
        store.begin_shard(1, 1, MiB).abort()  # 1 MiB and 2 replicas of it fit in 8 MiB
        with pytest.raises(CapacityError, match="replicas=2") as e:
            store.begin_shard(2, 0, 3 * MiB)  # 3 MiB and 2 x 3 MiB do not
        assert e.value.needed > 6 * MiB and e.value.needed > e.value.available
        store.begin_shard(2, 3, 3 * MiB).abort()  # a partner's replica counts only itself
    finally:
        store.close()

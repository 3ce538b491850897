"""Pure tests of the pairing strategy: who keeps a replica of whom, node by node and rank by rank."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlcheckpoint.replication import PairwiseRing
from mlcheckpoint.replication.schedule.pairing import (
    rank_sources,
    rank_targets,
    sources,
)

RING = PairwiseRing()
NODE_COUNTS = range(2, 34)


def targets_map(n: int) -> dict[int, int]:
    out = {}
    for node in range(n):
        t = RING.targets(node, n)
        assert len(t) == 1, f"node {node} of {n} has targets {t}"
        out[node] = t[0]
    return out


@pytest.mark.parametrize("n", NODE_COUNTS)
def test_every_node_has_one_other_target_and_one_source(n):
    for node in range(n):
        tgt = RING.targets(node, n)
        src = sources(RING, node, n)
        assert len(tgt) == 1 and tgt[0] != node and 0 <= tgt[0] < n, (node, n, tgt)
        assert len(src) == 1 and src[0] != node and 0 <= src[0] < n, (node, n, src)


@pytest.mark.parametrize("n", NODE_COUNTS)
def test_targets_are_a_permutation_without_fixed_points(n):
    t = targets_map(n)
    assert sorted(t.values()) == list(range(n))  # bijective: every node holds exactly one copy
    assert all(t[k] != k for k in t)
    # sources() is the inverse relation of targets()
    for node in range(n):
        assert sources(RING, t[node], n) == [node]


@pytest.mark.parametrize("n", NODE_COUNTS)
def test_shape_pairs_and_trailing_ring(n):
    t = targets_map(n)
    ring_start = n - 3 if n % 2 else n
    for node in range(ring_start):
        assert t[node] == node ^ 1 and t[t[node]] == node  # symmetric buddy pairs
    if n % 2:
        a, b, c = n - 3, n - 2, n - 1
        assert (t[a], t[b], t[c]) == (b, c, a)


@pytest.mark.parametrize("n", NODE_COUNTS)
def test_losing_any_single_node_leaves_a_copy_of_everyone_elses_data(n):
    t = targets_map(n)
    for lost in range(n):
        for owner in range(n):  # the lost node's own data included: its partner holds it
            live = {owner, t[owner]} - {lost}
            assert live, f"n={n}: losing node {lost} loses node {owner}'s data"
        # what the lost node held for others is still on its owner
        (src,) = sources(RING, lost, n)
        assert src != lost


def test_single_node_has_no_partner():
    assert RING.targets(0, 1) == []
    assert sources(RING, 0, 1) == []
    for local in range(4):
        assert rank_targets(RING, local, 4, 1) == []
        assert rank_sources(RING, local, 4, 1) == []


@pytest.mark.parametrize("node,n", [(-1, 2), (2, 2), (0, 0), (5, 3)])
def test_node_outside_the_job_is_refused(node, n):
    with pytest.raises(ValueError):
        RING.targets(node, n)


def test_known_small_layouts():
    assert [RING.targets(k, 2) for k in range(2)] == [[1], [0]]
    assert [RING.targets(k, 3) for k in range(3)] == [[1], [2], [0]]
    assert [RING.targets(k, 4) for k in range(4)] == [[1], [0], [3], [2]]
    assert [RING.targets(k, 5) for k in range(5)] == [[1], [0], [3], [4], [2]]


def test_rank_mapping_two_nodes_two_ranks():
    # ranks 0,1 on node 0; ranks 2,3 on node 1: local rank l pairs with local rank l
    assert [rank_targets(RING, r, 2, 2) for r in range(4)] == [[2], [3], [0], [1]]
    assert [rank_sources(RING, r, 2, 2) for r in range(4)] == [[2], [3], [0], [1]]


def test_rank_mapping_odd_ring_of_three_nodes_with_four_ranks_each():
    lws = 4
    for r in range(12):
        node, local = divmod(r, lws)
        (t,) = rank_targets(RING, r, lws, 3)
        (s,) = rank_sources(RING, r, lws, 3)
        assert divmod(t, lws) == ((node + 1) % 3, local)
        assert divmod(s, lws) == ((node - 1) % 3, local)


@given(n=st.integers(1, 64), lws=st.integers(1, 8), data=st.data())
def test_rank_targets_follow_node_targets(n, lws, data):
    rank = data.draw(st.integers(0, n * lws - 1))
    node, local = divmod(rank, lws)
    tgts = rank_targets(RING, rank, lws, n)
    srcs = rank_sources(RING, rank, lws, n)
    assert [divmod(t, lws) for t in tgts] == [(k, local) for k in RING.targets(node, n)]
    assert [divmod(s, lws) for s in srcs] == [(k, local) for k in sources(RING, node, n)]
    for t in tgts:  # a replica never lands on the owner's own node
        assert t // lws != node and 0 <= t < n * lws
        assert rank in rank_sources(RING, t, lws, n)  # and the partner knows it keeps it


@given(n=st.integers(2, 64), lws=st.integers(1, 8))
def test_rank_targets_are_a_permutation_of_all_ranks(n, lws):
    world = n * lws
    tgt = {}
    for r in range(world):
        (t,) = rank_targets(RING, r, lws, n)
        assert t % lws == r % lws and t // lws != r // lws
        tgt[r] = t
    assert sorted(tgt.values()) == list(range(world))
    for r in range(world):
        assert rank_sources(RING, tgt[r], lws, n) == [r]


@given(n=st.integers(2, 200), lost=st.data())
def test_any_single_loss_keeps_every_other_nodes_data(n, lost):
    k = lost.draw(st.integers(0, n - 1))
    for owner in range(n):
        (t,) = RING.targets(owner, n)
        assert {owner, t} - {k}, (n, k, owner)  # a live copy of every node's data, k's included
        assert len({owner, t}) == 2  # on two distinct nodes

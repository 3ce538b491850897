"""What a resume says to the user (issue 44): ``ResumeInfo.summary``, one line naming the step,
where it came from in words ("local", "from node N", "persistent") and, in one sentence, why a
newer step was not used; ``fell_back`` (logged at WARNING) only when more than a save in
flight was lost. Planned with the real planner on inventories, without processes."""

from __future__ import annotations

from helpers import restate
from test_planner import copy, inventories, paired

from mlcheckpoint.recovery import plan_resume
from mlcheckpoint.recovery.planner import FRESH, MEMORY, PERSISTENT
from mlcheckpoint.recovery.resume import ResumeInfo, _by_rank, _label, _note
from mlcheckpoint.store.inventory import StepState

FSDP = {0: [[]], 1: [[]]}  # sharded, no data-parallel copies: every item of a shard is its own


def fsdp(c: StepState) -> StepState:
    return restate(c, copy_groups=FSDP)


def node_lost_mid_save() -> list:
    """2 nodes x 1 rank of FSDP. Step 5 reached both nodes; step 6 was saved, but rank 1's
    shard of it had not reached node 0 when node 1 was lost (replaced by an empty machine)."""
    nodes = paired(2, 1, [], lost=[1])
    nodes[0].steps[5] = fsdp(copy({0, 1}, required=(0, 1), world_size=2))
    nodes[0].steps[6] = fsdp(copy({0}, required=(0, 1), world_size=2))
    return nodes


def test_a_node_lost_mid_save_says_which_newer_step_was_not_used_without_alarm():
    d = plan_resume(node_lost_mid_save(), None, 2)
    assert (d.kind, d.step) == (MEMORY, 5)
    # Nothing had a copy: no "nor do copies of all their items: lost are ..." clause.
    assert "cop" not in d.reason and "lost are" not in d.reason, d.reason
    note, fell_back = _note(d, memory_held=True)
    assert note == "newer step 6 in memory was not used: shards of ranks [1] are on no surviving node"
    assert not fell_back  # one save in flight: INFO
    info = ResumeInfo(5, "peer", 0.5712, {0: "local", 1: "peer"}, note=note,
                      labels={0: _label("local", {}), 1: _label("peer", {1: {0: 100}})})
    assert info.labels == {0: "local", 1: "from node 0"}
    assert str(info) == info.summary == (
        "restored step 5 in 0.57s (rank 0 local, rank 1 from node 0); newer step 6 in memory "
        "was not used: shards of ranks [1] are on no surviving node")


def test_labels_in_words_whatever_the_layout():
    # Items read through copies and partial replicas on two nodes: still "from nodes ...".
    assert _label("copies", {3: {0: 10}, 2: {1: 5}}) == "from nodes 0, 1"
    assert _label("copies", {}) == "local"  # the copies were on its own node
    assert _label("persistent", {}) == "persistent"
    assert _by_rank(dict.fromkeys(range(4), "local")) == "from local memory"
    assert _by_rank({0: "local", 1: "local", 2: "from node 0", 3: "from node 0", 5: "local"}) == \
        "ranks 0-1, 5 local, ranks 2-3 from node 0"


def test_fallbacks_are_said_and_flagged():
    # Memory wiped everywhere: the persistent step, at WARNING.
    d = plan_resume(inventories(2, 1, {}), 20, 2)
    note, fell_back = _note(d, memory_held=False)
    assert (d.kind, note, fell_back) == (PERSISTENT, "memory holds no checkpoint of this job", True)
    info = ResumeInfo(20, "persistent", 1.2, note=note, fell_back=fell_back)
    assert info.summary == ("restored step 20 from the persistent checkpoint in 1.20s; memory "
                            "holds no checkpoint of this job")
    # A newer persistent step: no loss, INFO.
    d = plan_resume(paired(2, 1, [3]), 9, 2)
    assert _note(d, memory_held=True) == ("persistent step 9 is newer than memory step 3", False)
    # Memory held steps, none usable, persistent older: WARNING.
    nodes = node_lost_mid_save()
    del nodes[0].steps[5]
    d = plan_resume(nodes, 4, 2)
    assert d.kind == PERSISTENT and _note(d, memory_held=True) == (
        "newer step 6 in memory was not used: shards of ranks [1] are on no surviving node", True)
    # Two newer steps skipped for an older memory step: more than a save in flight, WARNING.
    nodes = node_lost_mid_save()
    nodes[0].steps[7] = nodes[0].steps[6]
    d = plan_resume(nodes, None, 2)
    assert d.step == 5 and _note(d, memory_held=True) == (
        ("newer step 7 in memory was not used (nor 1 older step): shards of ranks [1] are on no "
        "surviving node"), True)
    # A first launch: nothing anywhere, INFO.
    d = plan_resume(inventories(2, 1, {}), None, 2)
    note, fell_back = _note(d, memory_held=False)
    assert (d.kind, fell_back) == (FRESH, False)
    assert ResumeInfo(None, None, 0.01, note=note).summary == (
        "nothing restored, starting fresh: memory holds no checkpoint of this job and there is "
        "no persistent checkpoint")

"""Failure domains: partners across racks (switches, power feeds), property-tested, and a
whole domain lost at once with real processes.

The pure part: ``domain_targets`` pairs nodes so that no node's partner shares its domain
when another placement allows it, and every node sends to one node and receives from one.
The multi-node part: four simulated nodes in racks {0, 1} and {2, 3}; both nodes of rack 0
are lost (wiped, as replacement machines) and the job resumes from memory, while the same
job without domains (pairs 0<->1, 2<->3) has lost both copies of rack 0's shards.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
from cluster import Cluster
from hypothesis import given
from hypothesis import strategies as st

from mlcheckpoint import cli
from mlcheckpoint.errors import ConfigError
from mlcheckpoint.replication.schedule.pairing import (
    DomainPairing,
    PairwiseRing,
    domain_targets,
    pairing_for,
    rank_sources,
    rank_targets,
    sources,
)
from mlcheckpoint.settings import Launcher, ReplicationOptions
from mlcheckpoint.topology import Topology

# Up to 24 nodes in up to 6 domains; "" is a node that names no domain.
DOMAINS = st.lists(st.sampled_from(["", "r0", "r1", "r2", "r3", "r4", "r5"]), min_size=2,
                   max_size=24)


def alone(domains: list[str]) -> list[str]:
    """Each node's effective domain: one that names none shares it with nobody."""
    return [d or f"node{i}" for i, d in enumerate(domains)]


@given(DOMAINS)
def test_balanced_every_node_sends_to_one_and_receives_from_one(domains):
    targets = domain_targets(domains)
    n = len(domains)
    assert sorted(targets) == list(range(n))  # receives from exactly one
    assert all(t != node for node, t in enumerate(targets))  # never itself


@given(DOMAINS)
def test_no_partner_in_its_own_domain_when_avoidable(domains):
    targets = domain_targets(domains)
    effective = alone(domains)
    n = len(domains)
    same = [node for node, t in enumerate(targets) if effective[node] == effective[t]]
    largest = max(Counter(effective).values())
    # each node receives from one node, so of a domain holding m > n/2 nodes only n - m can
    # send outside it: 2m - n must pair inside, and no more may
    assert len(same) == max(0, 2 * largest - n), (domains, targets)


@given(DOMAINS)
def test_losing_any_domain_of_at_most_half_the_nodes_keeps_a_copy_of_everything(domains):
    targets = domain_targets(domains)
    effective = alone(domains)
    for lost in set(effective):
        members = {node for node, d in enumerate(effective) if d == lost}
        if 2 * len(members) <= len(domains):
            # every node's data is on itself and its partner: one of them survives
            assert all({node, targets[node]} - members for node in range(len(domains)))


@given(st.integers(1, 12), st.integers(1, 12))
def test_racks_of_equal_size_pair_across_racks(racks, per_rack):
    domains = [f"rack{i // per_rack}" for i in range(racks * per_rack)]
    if len(domains) < 2:
        return
    targets = domain_targets(domains)
    if racks > 1:
        assert all(domains[t] != domains[node] for node, t in enumerate(targets))


@given(DOMAINS, st.integers(1, 4))
def test_rank_pairing_follows_node_pairing(domains, local_world):
    strategy = pairing_for(domains)
    n = len(domains)
    for rank in range(n * local_world):
        node, local = divmod(rank, local_world)
        (target,) = rank_targets(strategy, rank, local_world, n)
        assert target % local_world == local
        assert target // local_world == strategy.targets(node, n)[0]
        assert len(rank_sources(strategy, rank, local_world, n)) == 1


def test_losing_a_whole_rack_keeps_one_copy_of_everything():
    domains = ["rack0", "rack0", "rack1", "rack1"]
    targets = domain_targets(domains)
    assert targets == [2, 3, 0, 1]  # mutual pairs across the racks
    for node in (0, 1):
        assert domains[targets[node]] == "rack1"
        assert domains[sources(DomainPairing(domains), node, 4)[0]] == "rack1"


def test_without_domains_the_pairs_are_todays():
    for domains in (["", "", "", ""], ["a", "a", "a"], ["x"] * 5):
        assert isinstance(pairing_for(domains), PairwiseRing)
    assert isinstance(pairing_for(["a", "a", "b"]), DomainPairing)
    assert isinstance(pairing_for(["a", "", ""]), DomainPairing)  # unnamed nodes stand alone


def test_domain_pairing_refuses_another_node_count():
    with pytest.raises(ValueError):
        DomainPairing(["a", "b"]).targets(0, 3)
    with pytest.raises(ValueError):
        DomainPairing(["a", "b"]).targets(2, 2)


@pytest.mark.parametrize("addr,pattern,domain", [
    ("sh04.sh04-isw-16.sh04-16n05", "switch.switch.node", "sh04.sh04-isw-16"),
    (".ib-core.tors-r1pac16.gpu027", "switch.switch.switch.node", ".ib-core.tors-r1pac16"),
    ("c4-n10", "node", None),  # no topology plugin: the node alone
    (None, None, None),
    ("a.b", None, None),
])
def test_slurm_topology_address_names_the_leaf_switch(clean_env, addr, pattern, domain):
    for var, value in (("SLURM_TOPOLOGY_ADDR", addr), ("SLURM_TOPOLOGY_ADDR_PATTERN", pattern)):
        if value is not None:
            clean_env.setenv(var, value)
        else:
            clean_env.delenv(var, raising=False)
    assert Launcher.from_env().slurm_failure_domain() == domain


def test_the_argument_wins_over_the_variable_and_the_variable_over_slurm(clean_env):
    clean_env.setenv("SLURM_TOPOLOGY_ADDR", "spine.leaf3.node9")
    clean_env.setenv("SLURM_TOPOLOGY_ADDR_PATTERN", "switch.switch.node")
    def resolve(**fields):
        return ReplicationOptions(**fields).resolved()

    assert resolve().failure_domain == "spine.leaf3"
    clean_env.setenv("MLCHECKPOINT_FAILURE_DOMAIN", "rack-7")
    assert resolve().failure_domain == "rack-7"
    assert resolve(failure_domain="pdu-2").failure_domain == "pdu-2"
    for bad in ("  ", "rack\n1", "x" * 300, 12):
        with pytest.raises(ConfigError, match="failure_domain"):
            resolve(failure_domain=bad)


def test_a_node_takes_its_local_rank_0s_domain():
    topo = Topology(rank=3, world_size=6, local_rank=1, local_world_size=2, node_rank=1,
                    num_nodes=3)
    agreed = topo.with_domains(["a", "a", "b", None, None, "c"])
    assert agreed.domains == ("a", "b", "")
    assert [agreed.describe_node(n) for n in range(3)] == ["node 0 (a)", "node 1 (b)", "node 2"]


# ---------------------------------------------------------------------------- a whole rack lost
RACKS = ["rack-a", "rack-a", "rack-b", "rack-b"]


def specs(c: Cluster, table: dict[str, dict]) -> str:
    return json.dumps([dict(spec, job=c.sub_job(name)) for name, spec in table.items()])


def launch(c: Cluster, table: dict[str, dict]) -> None:
    c.clear_results()
    c.run("elastic_job.py", specs(c, table), timeout=180)


def ls(c: Cluster, node: int, name: str, capsys) -> str:
    capsys.readouterr()
    assert cli.main(["--local-dir", c.nodes[node].local_dir, "ls", "--job", c.sub_job(name)]) == 0
    return capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_losing_a_whole_domain_resumes_from_memory(capsys):
    """With failure domains (racks), partners sit in other racks: losing a whole rack resumes
    from memory, where flat pairs lose both copies; ls names partners and racks."""
    with Cluster(4) as c:
        save = {"first": 1, "last": 3}
        launch(c, {"racks": dict(save, domains=RACKS), "flat": save})
        logs = c.logs()
        saved = {"racks": c.sub_job_results("acked", "racks"),
                 "flat": c.sub_job_results("acked", "flat")}
        listing = {node: ls(c, node, "racks", capsys) for node in range(4)}
        flat_listing = ls(c, 0, "flat", capsys)
        for node in (0, 1):  # rack-a is lost: both its machines come back empty
            c.nodes[node].wipe()
        launch(c, {"racks": {"first": 1, "last": 0, "domains": RACKS},
                   "flat": {"first": 1, "last": 0}})
        racks, flat = c.sub_job_results("resume", "racks"), c.sub_job_results("resume", "flat")
        after = c.logs()

    for name in ("racks", "flat"):
        assert all(r["steps"] == [1, 2, 3] for r in saved[name].values()), (name, saved, logs[-6000:])
    # the start-up log and `mlcheckpoint ls` name each node's partner and its domain
    assert "node 0 (rack-a) replicates to node 2 (rack-b)" in logs, logs[-6000:]
    assert "node 2 (rack-b) replicates to node 0 (rack-a)" in logs, logs[-6000:]
    assert "partner: node 2 (rack-b)" in listing[0] and "node 0 (rack-a)" in listing[0], listing[0]
    assert "partner: node 1 (rack-a)" in listing[3], listing[3]
    assert "partner: node 1" in flat_listing, flat_listing  # today's pairs, no domain named

    assert sorted(racks) == [0, 1, 2, 3], after[-8000:]
    for rank, r in racks.items():
        assert r["step"] == 3 and r["match"] and not r["mismatch"], (rank, r)
        assert r["source"] == "peer", (rank, r)
    # without domains node 0's partner was node 1, in the same rack: both copies are gone
    for rank, r in flat.items():
        assert r["step"] is None, (rank, r)

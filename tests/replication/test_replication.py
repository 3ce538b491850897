"""Peer replication end to end: real torchrun jobs over simulated nodes (one tmpfs dir each).

After the saves, the test process opens every node's store itself and checks that each rank's
shard of the newest step is committed on exactly two nodes, its own and its partner's, with the
same bytes and checksums, that every node holds the step's metadata, and that the managers
report the step replicated and protected.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from cluster import WORKERS, Cluster

from mlcheckpoint.replication import PairwiseRing
from mlcheckpoint.replication.schedule.pairing import rank_sources, rank_targets
from mlcheckpoint.store import LocalStore, layout

sys.path.insert(0, WORKERS)
from states import make_state

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.usefixtures("whole_replicas")]

LAUNCH_TIMEOUT = 150
LAST = 2  # steps 0..LAST are saved; with keep=2 retention runs on both nodes of every pair


def node_stores(c: Cluster) -> list[LocalStore]:
    return [LocalStore(n.local_dir, c.job_id, create=False) for n in c.nodes]


def read_data(store: LocalStore, step: int, rank: int, nbytes: int) -> bytes:
    with open(store.paths.data(step, rank), "rb") as f:
        data = f.read(nbytes)
    assert len(data) == nbytes, f"{store.paths.data(step, rank)} holds {len(data)} of {nbytes} bytes"
    return data


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def check_replicated(c: Cluster, nnodes: int, nproc: int, last: int = LAST) -> None:
    world = nnodes * nproc
    ring = PairwiseRing()
    res = c.results("replicate")
    assert sorted(res) == list(range(world)), f"ranks reporting: {sorted(res)}; logs:\n{c.logs()}"
    stores = node_stores(c)

    # --- what each rank's manager says
    for r, rep in res.items():
        assert rep["targets"] == rank_targets(ring, r, nproc, nnodes), (r, rep)
        assert rep["sources"] == rank_sources(ring, r, nproc, nnodes), (r, rep)
        assert rep["protected"] is True, f"rank {r}: step {last} never protected; logs:\n{c.logs()}"
        entries = {e["step"]: e for e in rep["listing"] if e["location"] == "memory"}
        assert last in entries, f"rank {r} lists {sorted(entries)}"
        e = entries[last]
        # "complete" = every rank's shard on this node: only when a pair spans the whole job
        assert e["state"] == ("complete" if nnodes == 2 else "incomplete"), (r, e)
        assert e["replication"] == "replicated", (r, e)
        assert e["protected"] is True, (r, e)

    # --- what is on each node's tmpfs: own shards and the partner's, nothing else of `last`
    for r in range(world):
        home = r // nproc
        (partner_rank,) = rank_targets(ring, r, nproc, nnodes)
        partner = partner_rank // nproc
        assert partner != home
        holders = [k for k, s in enumerate(stores) if os.path.exists(s.paths.manifest(last, r))]
        assert holders == sorted({home, partner}), \
            f"rank {r}'s shard of step {last} committed on nodes {holders}, want {home} and {partner}"
        copies = []
        for k in holders:
            s = stores[k]
            m = s.verify_shard(last, r)  # every item's checksum holds on this node
            assert (m.job_id, m.step, m.rank) == (c.job_id, last, r)
            copies.append((m, read_data(s, last, r, m.data_bytes)))
        (m0, d0), (m1, d1) = copies
        assert m0.data_bytes == m1.data_bytes
        # every tensor is stored once, in the mapped (staged) region; byte items follow it
        # (a PROCESS-mode save used to append a second copy of every tensor after them)
        tensor_end = max(i.offset + i.nbytes for i in m0.items if i.kind == "tensor")
        bytes_start = min((i.offset for i in m0.items if i.kind == "bytes"), default=tensor_end)
        assert tensor_end <= bytes_start, [(i.key, i.kind, i.offset) for i in m0.items]
        assert [(i.key, i.offset, i.nbytes, i.checksum) for i in m0.items] == \
            [(i.key, i.offset, i.nbytes, i.checksum) for i in m1.items]
        assert d0 == d1, f"rank {r}'s shard of step {last} differs between nodes {holders}"
        # ... and the bytes are that rank's own state, not some other rank's
        own = make_state(last, r)[f"rank{r}"]["opt"]
        (item,) = [i for i in m0.items if i.key.split("@")[0] == f"rank{r}.opt"]
        assert d0[item.offset:item.offset + item.nbytes] == tensor_bytes(own)

    # --- nothing uncommitted left behind in the newest step, and metadata on every node
    payloads = []
    for k, s in enumerate(stores):
        names = os.listdir(s.paths.step_dir(last))
        assert not [n for n in names if n.endswith((layout.INFLIGHT, layout.TMP))], (k, names)
        header, payload = s.metadata.read(last)  # verifies its checksum
        assert header.step == last and header.world_size == world, (k, header)
        assert header.ranks == list(range(world)), (k, header)
        payloads.append(payload)
        st = s.inventory.step_state(last)
        assert st.has_metadata
        # the worker saw the same (it verified every shard it held)
        for r in range(k * nproc, (k + 1) * nproc):
            held = res[r]["held"][str(last)]
            assert held["metadata"] is True
            assert held["ranks"] == sorted(st.committed_ranks), (k, r, held)
    assert all(p == payloads[0] for p in payloads), "nodes hold different metadata of the step"


CASES = [
    # nnodes, nproc, save mode, transport
    pytest.param(2, 2, "async", "tcp", id="tcp-2nodes-x2ranks"),
    pytest.param(4, 1, "sync", "tcp", id="tcp-4nodes"),
    pytest.param(3, 1, "async", "tcp", id="tcp-3nodes-odd-ring"),
    pytest.param(2, 1, "dcp", "pg", id="pg-2nodes"),
    pytest.param(2, 1, "dcp_async_process", "tcp", id="tcp-2nodes-dcp-process-mode"),
]


@pytest.mark.parametrize("nnodes,nproc,mode,transport", CASES)
def test_newest_step_lives_on_two_nodes(nnodes, nproc, mode, transport):
    """Per layout and transport, each rank's shard of the newest step is committed on its own
    node and its partner's, identical, with the metadata on every node."""
    with Cluster(nnodes, nproc) as c:
        c.run("replicate.py", str(LAST), mode, transport, timeout=LAUNCH_TIMEOUT)
        check_replicated(c, nnodes, nproc)


def test_striped_replication_in_a_job():
    """Shards pushed over 3 TCP streams each (stripes made small so a test-sized shard splits)
    land byte-identical and verified, exactly as single-stream ones do."""
    with Cluster(2, 2) as c:
        c.run("replicate.py", str(LAST), "sync", "tcp", timeout=LAUNCH_TIMEOUT,
              env={"MLCHECKPOINT_TCP_STREAMS": "3", "MLCHECKPOINT_TCP_MIN_STRIPE": "1024"})
        check_replicated(c, 2, 2)
        # every rank's listener took its partner's shards over 3 streams (step LAST at least),
        # and never over another number of streams
        for rank, r in c.results("replicate").items():
            assert set(r["striped"]) == {"3"}, (rank, r["striped"])

"""A holder killed while a resume reads from it (issue 38, fallback to copies), or while a
replaced node rebuilds a shard from it after the load: the items it was dealt are read from
their copies on another node, before the step is given up.

Real processes and sockets (tests/tcp_job.py): nodes 0 and 1 are TCP endpoints in processes of
their own (tests/workers/repl_peer.py), node 0 holding the items' primaries, node 1 a copy of
each; node 2, a replacement with only the metadata, loads the step in this process through
recovery's ``Holders``. Node 0 is SIGKILLed by its ``serve_mid_read`` crash point as it starts
sending the first read (mlcheckpoint/_faults.py). A holder rank of a torchrun job cannot die
this way while the job resumes: it is in the load's collectives too.
"""

from __future__ import annotations

import pickle
import signal

import pytest
import torch.distributed.checkpoint as dcp
from helpers import WAIT
from states import assert_same, clone_state, make_state, zeros_like_state

from mlcheckpoint import MemoryStorageReader, MemoryStorageWriter
from mlcheckpoint.recovery.holders import Holders
from mlcheckpoint.recovery.planner import MEMORY, Decision
from mlcheckpoint.recovery.resume import load_step
from mlcheckpoint.store import LocalStore
from mlcheckpoint.store.identity import Lineage
from mlcheckpoint.store.layout import ItemLocation
from mlcheckpoint.topology import Topology

STEP = 4

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def save_with_copies(stores: list[LocalStore]) -> dict:
    """Rank 0's shard of a step on stores[0] (every item's primary), the same bytes as rank 1's
    shard on stores[1] (a copy of every item, at the same offsets), and the step's metadata,
    naming the copies, on all three. Returns the state saved."""
    sd = make_state(STEP)
    expected = clone_state(sd)
    dcp.save(sd, storage_writer=MemoryStorageWriter(STEP, stores[0]))
    header, payload = stores[0].metadata.read(STEP)
    m = stores[0].shards.read_manifest(STEP, 0)
    copy = stores[1].begin_shard(STEP, 1, m.data_bytes)
    with stores[0].shards.open(STEP, 0) as source:
        copy.buffer.array[:] = bytearray(source.read(0, m.data_bytes))
    for item in m.items:
        copy.add_item(item)
    copy.commit(3, save_id=header.save_id, run_id=header.run_id)
    md = pickle.loads(payload)
    for index, loc in md.storage_data.items():
        md.storage_data[index] = ItemLocation(rank=0, offset=loc.offset, nbytes=loc.nbytes,
                                              checksum=loc.checksum, is_tensor=loc.is_tensor,
                                              copies=((1, loc.offset),))
    locations = list(md.storage_data.values())
    for store in stores:
        store.metadata.write(STEP, pickle.dumps(md), world_size=3, ranks={0},
                             total_bytes=sum(loc.nbytes for loc in locations),
                             save_id=header.save_id,
                             lineage=Lineage.from_header(header.run_id, header.lineage))
    return expected


def dying_primary_and_copy(job, stores: list[LocalStore]):
    """Node 0 serving the items' primaries (SIGKILLed as it starts sending a read), node 1
    serving their copies, and node 2's ``Holders`` over them: (node 0's process, holders)."""
    primary = job.spawn(0, "serve", timeout=WAIT, env={"MLCHECKPOINT_CRASH_AT": f"serve_mid_read@{STEP}#0"})
    copy = job.spawn(1, "serve", timeout=WAIT)
    job.status("0.ready", primary)
    job.status("1.ready", copy)
    reader = job.endpoint(2, timeout=WAIT)
    header, _ = stores[2].metadata.read(STEP)
    plan = Decision(MEMORY, STEP, holders={0: [0], 1: [1]}, metadata_holders=[0, 1, 2],
                    save_id=header.save_id, data_bytes={0: stores[0].shards.read_manifest(STEP, 0).data_bytes})
    here = Topology(rank=2, world_size=3, local_rank=0, local_world_size=1, node_rank=2,
                    num_nodes=3)
    return primary, Holders(reader, stores[2], here, plan)


def test_a_holder_killed_mid_read_is_replaced_by_the_copy_on_another_node(make_job):
    """The node serving a read dies mid-read: the reader takes every byte from the copy on
    another node and loads exactly."""
    job = make_job(3)
    stores = [job.store(r) for r in range(3)]
    try:
        expected = save_with_copies(stores)
        primary, holders = dying_primary_and_copy(job, stores)
        out = zeros_like_state(expected)
        load_step(out, MemoryStorageReader(STEP, stores[2], node=2, remote=holders,
                                           save_id=holders.plan.save_id), None)
        assert_same(expected, out)
        assert primary.wait(timeout=WAIT) == -signal.SIGKILL, job.logs()  # it did die mid-read
        # everything came from node 1's copy, none of it from the node that died
        total = sum(loc.nbytes for loc in pickle.loads(stores[2].metadata.read(STEP)[1]).storage_data.values())
        assert holders.bytes_served == {1: {1: total}}, holders.bytes_served
    finally:
        for store in stores:
            store.close()


def test_a_holder_killed_mid_rebuild_is_replaced_by_the_copy_on_another_node(make_job):
    """The node serving the rebuild of rank 0's shard (after a load, in the background) dies
    mid-read: the rebuild takes the items it was dealt from their copies on node 1, and
    commits the shard as its save left it."""
    job = make_job(3)
    stores = [job.store(r) for r in range(3)]
    try:
        save_with_copies(stores)
        m = stores[0].shards.read_manifest(STEP, 0)
        primary, holders = dying_primary_and_copy(job, stores)
        assert holders.rebuild(0)
        assert primary.wait(timeout=WAIT) == -signal.SIGKILL, job.logs()  # it did die mid-read
        rebuilt = stores[2].verify_shard(STEP, 0)  # every item's bytes against its checksum
        assert rebuilt.items == m.items  # the manifest's items as its save wrote them
        assert (rebuilt.save_id, rebuilt.data_bytes, rebuilt.partial) == (m.save_id, m.data_bytes, False)
    finally:
        for store in stores:
            store.close()

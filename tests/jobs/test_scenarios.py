"""The failure scenarios, one table each: what a job resumes after its memory is lost or bad,
and what is left after a process dies mid-save or mid-transfer.

Each table is one parametrized test; its rows name what is done to the job and what it must
resume or leave. Rows that need real processes are marked slow.

- persistent fallback: memory gone, or nothing in it that verifies, or older than the
  persistent tier: the persistent step is loaded, exactly, and the reason says why;
- a process killed while it receives a shard (the receiver, or a sender over one stream or
  several): nothing is committed, no buffer is left behind once gc (or the receiver) has
  run, and the next push of the same shard lands verified.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from helpers import WAIT, assert_same, flip_byte, make_state, wait_for, zeros_like_state
from tcp_job import debris, make_shard

from mlcheckpoint import CheckpointManager, ShardNotFoundError
from mlcheckpoint.replication import ReplicationError, sink
from mlcheckpoint.store import LocalStore, layout

JOB = "job-scenarios"
MiB = 1 << 20

# DCP warns that it assumes a single process when no process group is initialised.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


# ============================================================================ persistent fallback
def _manager(local: str, persistent: str) -> CheckpointManager:
    return CheckpointManager(persistent, job_id=JOB, local_dir=local, replication="none", keep=3)


def _flip(ckpt: CheckpointManager, step: int) -> None:
    """One bit of the step's first item flips in memory."""
    item = ckpt.store.read_manifest(step, 0).items[0]
    flip_byte(ckpt.store.data_path(step, 0), item.offset)


def _truncate(ckpt: CheckpointManager, step: int) -> None:
    m = ckpt.store.read_manifest(step, 0)
    os.truncate(ckpt.store.data_path(step, 0), m.data_bytes // 2)


@dataclass(frozen=True)
class Fallback:
    """Steps saved to memory and to the persistent tier, then what happens to memory."""

    memory: tuple[int, ...]
    persistent: tuple[int, ...]
    damage: Callable[[CheckpointManager], None]
    resumed: tuple[int, str]  # (step, source)
    reason_names: tuple[str, ...] | None = ()  # each is in ResumeInfo.reason; None: no reason


FALLBACKS = {
    "memory_lost": Fallback(
        memory=(5,), persistent=(4,), damage=lambda ckpt: ckpt.store.destroy(),
        resumed=(4, "persistent")),
    "all_memory_corrupt": Fallback(
        memory=(2,), persistent=(1,),  # step 1 is in memory too
        damage=lambda ckpt: (_flip(ckpt, 2), _truncate(ckpt, 1)),
        resumed=(1, "persistent"),
        reason_names=("step 2", "checksum mismatch", "step 1", "truncated")),
    "persistent_newer": Fallback(
        memory=(3,), persistent=(6,), damage=lambda ckpt: ckpt.store.retire_shard(6, 0),
        resumed=(6, "persistent"), reason_names=("persistent step 6",)),
    "memory_newer": Fallback(  # the contrast: intact memory at least as new wins
        memory=(5,), persistent=(4,), damage=lambda ckpt: None, resumed=(5, "local"),
        reason_names=None),
}


@pytest.mark.parametrize("case", list(FALLBACKS))
def test_persistent_fallback(store_dir, case):
    row = FALLBACKS[case]
    local, persistent = os.path.join(store_dir, "local"), os.path.join(store_dir, "persistent")
    with _manager(local, persistent) as ckpt:
        for step in sorted(row.memory + row.persistent):
            ckpt.save(make_state(step), step, persistent=step in row.persistent)
        row.damage(ckpt)
    with _manager(local, persistent) as ckpt:  # the restarted job
        out = zeros_like_state(make_state())
        info = ckpt.resume(out)
    step, source = row.resumed
    assert (info.step, info.source) == (step, source), info
    assert info.sources == {0: source}, info
    if row.reason_names is None:
        assert info.reason is None, info.reason
    else:
        for words in row.reason_names:
            assert words in (info.reason or ""), info.reason
    assert_same(make_state(step), out)


# ============================================================================ killed mid-transfer
@dataclass(frozen=True)
class Cut:
    """Which end of a replica push dies (SIGKILL at its own crash point, half way through,
    so the bytes it never sent cannot sit in socket buffers and complete the shard)."""

    dies: str  # "receiver" or "sender"
    streams: int


CUTS = {
    "receiver": Cut("receiver", 1),
    "receiver_striped": Cut("receiver", 4),
    "sender": Cut("sender", 1),
    "sender_striped": Cut("sender", 4),
}
CUT_STEP, CUT_BYTES = 7, 32 * MiB


def _push_to_a_dying_receiver(job, streams: int) -> LocalStore:
    """Rank 0 (here) pushes its shard to rank 1, a process that dies once half has landed.
    Returns rank 1's store, as the dead process left it."""
    sender = job.endpoint(0, streams=streams, min_stripe_bytes=MiB)
    make_shard(sender.store, CUT_STEP, 0, CUT_BYTES, seed=1)
    proc = job.spawn(1, "serve", env={"MLCHECKPOINT_CRASH_AT": f"replica_mid_recv@{CUT_STEP}#0"})
    job.status("1.ready", proc)
    with pytest.raises(ReplicationError):
        sender.push_shard(1, CUT_STEP, 0)
    assert proc.wait(timeout=WAIT) == -signal.SIGKILL, job.logs()
    rstore = LocalStore(job.node_dir(1), job.job_id, create=False)
    # the dead receiver could not drop its buffer: gc does, and removes nothing else
    left = debris(rstore)
    assert left, "expected the half-received buffer to be left behind"
    assert sorted(os.path.basename(x) for x in rstore.gc()) == sorted(left)
    # the sender is unharmed: its copy verifies, and a push to the dead peer fails, not hangs
    sender.store.verify_shard(CUT_STEP, 0)
    with pytest.raises(ReplicationError):
        sender.push_shard(1, CUT_STEP, 0)
    return rstore


def _push_from_a_dying_sender(job, streams: int, monkeypatch) -> LocalStore:
    """Rank 1, a process, pushes its shard to rank 0 (here) and dies half way; rank 0 holds
    the transfer at half way meanwhile, so it can be looked at while it is open. Then rank 2
    (here), which holds the same shard, pushes it in full. Returns rank 0's store."""
    owner = 1
    half_received, go_on = threading.Event(), threading.Event()
    real_crash_point = sink.crash_point

    def pause_at_half(name, s=None, r=None):  # receiver side: hold the transfer at half way
        if name == "replica_mid_recv" and (s, r) == (CUT_STEP, owner) and not half_received.is_set():
            half_received.set()
            go_on.wait(WAIT)
        real_crash_point(name, s, r)

    monkeypatch.setattr(sink, "crash_point", pause_at_half)
    receiver = job.endpoint(0)
    rstore = receiver.store
    proc = job.spawn(owner, "push", peer=0, step=CUT_STEP, nbytes=CUT_BYTES, seed=3, streams=streams,
                     min_stripe_bytes=MiB, env={"MLCHECKPOINT_CRASH_AT": f"replica_mid_send@{CUT_STEP}"})
    try:
        wait_for(half_received.is_set, "the receiver to get half the shard", diag=job.logs)
        assert os.path.exists(rstore.data_path(CUT_STEP, owner) + layout.PARTIAL)
        with pytest.raises(ShardNotFoundError):
            rstore.read_manifest(CUT_STEP, owner)
        assert proc.wait(timeout=WAIT) == -signal.SIGKILL, job.logs()
    finally:
        go_on.set()
    # the receiver stays up and drops the cut transfer itself: gc finds nothing left
    wait_for(lambda: len(receiver.server.stripes) == 0 and debris(rstore) == [],
             "the receiver to drop the cut transfer's buffer", diag=job.logs)
    assert not os.path.exists(os.path.join(job.status_dir, f"{owner}.result"))  # sender never finished
    assert rstore.gc() == []
    with pytest.raises(ShardNotFoundError):
        rstore.read_manifest(CUT_STEP, owner)
    # another rank holding the same shard pushes it in full, and it lands verified
    other = job.endpoint(2, streams=streams, min_stripe_bytes=MiB)
    m = make_shard(other.store, CUT_STEP, owner, CUT_BYTES, seed=3)
    assert other.push_shard(0, CUT_STEP, owner) == CUT_BYTES
    got = rstore.verify_shard(CUT_STEP, owner)
    assert [(i.offset, i.nbytes, i.checksum) for i in got.items] == \
        [(i.offset, i.nbytes, i.checksum) for i in m.items]
    with open(rstore.data_path(CUT_STEP, owner), "rb") as a, \
            open(other.store.data_path(CUT_STEP, owner), "rb") as b:
        assert a.read(CUT_BYTES) == b.read(CUT_BYTES)
    assert debris(rstore) == []
    return rstore


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CUTS))
def test_killed_mid_transfer(make_job, monkeypatch, case):
    row = CUTS[case]
    if row.dies == "receiver":
        rstore = _push_to_a_dying_receiver(make_job(world=2), row.streams)
        owner = 0
    else:
        rstore = _push_from_a_dying_sender(make_job(world=3), row.streams, monkeypatch)
        owner = 1
    # whatever is left of the cut step is never taken for a checkpoint
    st = rstore.step_state(CUT_STEP)
    if row.dies == "receiver":
        assert not st.committed_ranks
    else:
        assert st.committed_ranks == {owner}  # the full push that followed
    assert not st.has_metadata and rstore.complete_steps() == []

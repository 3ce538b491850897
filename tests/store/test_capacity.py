"""Capacity: memory_limit_bytes and a really full tmpfs raise CapacityError and lose nothing."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import mounted_tmpfs

from mlcheckpoint import CapacityError, CheckpointManager
from mlcheckpoint.store import LocalStore
from mlcheckpoint.testing import internals

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

JOB = "job-capacity"
MiB = 1 << 20


def state(step: int, mib: float = 1.0) -> dict:
    n = int(mib * MiB) // 4
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(n, generator=g), "step": step}


def zeros(mib: float = 1.0) -> dict:
    return {"w": torch.zeros(int(mib * MiB) // 4), "step": -1}


def mib_str(n: int) -> str:
    return f"{n / MiB:.1f}"


def check_message(e: CapacityError) -> None:
    assert e.needed > e.available >= 0
    msg = str(e)
    assert mib_str(e.needed) in msg and "MiB" in msg


def limited_manager(local_dir: str, limit: int | None, keep: int) -> CheckpointManager:
    return CheckpointManager(job_id=JOB, local_dir=local_dir, keep=keep, memory_limit_bytes=limit,
                             replication="none")


def usage_after_one_save(local_dir: str) -> int:
    """Bytes one 1 MiB checkpoint takes in the store (data, manifest, metadata, lock).

    Without the buffers the manager prepares for the next saves in the background: whether
    they exist yet when this measures is a race, and the limits below must not depend on it.
    """
    probe_dir = os.path.join(local_dir, "probe")
    with limited_manager(probe_dir, None, keep=1) as ckpt:
        ckpt.save(state(0), 0)
        store = internals(ckpt).store
    total = 0  # after close: the preparation has finished
    for root, dirs, files in os.walk(store.job_dir):
        dirs[:] = [d for d in dirs if os.path.join(root, d) != store.pool_dir]
        total += sum(os.stat(os.path.join(root, f)).st_blocks * 512 for f in files)
    return total


@pytest.mark.parametrize("how", ["save", "async_save"])
def test_memory_limit_raises_and_keeps_committed(store_dir, how):
    local = os.path.join(store_dir, "local")
    one = usage_after_one_save(store_dir)
    limit = one + 256 * 1024  # room for one checkpoint, not two
    with limited_manager(local, limit, keep=1) as ckpt:
        first = state(1)
        ckpt.save(first, 1)
        assert internals(ckpt).store.capacity.usage_bytes() <= limit

        with pytest.raises(CapacityError) as ei:
            if how == "save":
                ckpt.save(state(2), 2)
            else:
                ckpt.async_save(state(2), 2).result(timeout=60)
        e = ei.value
        check_message(e)
        assert mib_str(limit) in str(e)  # names the limit
        assert internals(ckpt).store.inventory.complete_steps() == [1]
        internals(ckpt).store.verify_shard(1, 0)
        ckpt.wait()  # a failed async save leaves nothing in flight that could hang
        assert internals(ckpt).store.capacity.usage_bytes() <= limit

        # Training continues: a smaller state fits; committing it retires step 1 into the pool,
        # whose buffer then takes the next full-size save without growing usage.
        ckpt.save(state(3, mib=0.0625), 3)
        assert internals(ckpt).store.inventory.complete_steps() == [3]
        if how == "save":
            ckpt.save(state(4), 4)
        else:
            ckpt.async_save(state(4), 4).result(timeout=60)
        assert internals(ckpt).store.inventory.complete_steps() == [4]
        assert internals(ckpt).store.capacity.usage_bytes() <= limit

    with limited_manager(local, limit, keep=1) as ckpt:  # restart
        out = zeros()
        info = ckpt.resume(out)
        assert (info.step, info.source) == (4, "local")
        assert torch.equal(out["w"], state(4)["w"]) and out["step"] == 4


def test_memory_limit_failure_then_resume_earlier_step(store_dir):
    local = os.path.join(store_dir, "local")
    limit = usage_after_one_save(store_dir) + 128 * 1024
    with limited_manager(local, limit, keep=1) as ckpt:
        ckpt.save(state(1), 1)
        with pytest.raises(CapacityError):
            ckpt.save(state(2, mib=2), 2)
        with pytest.raises(CapacityError):
            ckpt.async_save(state(2, mib=2), 2).result(timeout=60)
    with limited_manager(local, limit, keep=1) as ckpt:
        out = zeros()
        info = ckpt.resume(out)
        assert info.step == 1 and info.source == "local"
        assert torch.equal(out["w"], state(1)["w"])


def test_begin_shard_checks_limit_before_writing(store_dir):
    store = LocalStore(store_dir, JOB, memory_limit_bytes=64 * 1024)
    try:
        before = sorted(os.listdir(store.job_dir)), store.capacity.usage_bytes()
        with pytest.raises(CapacityError) as ei:
            store.begin_shard(1, 0, MiB)
        assert ei.value.needed == MiB
        assert ei.value.available <= 64 * 1024
        check_message(ei.value)
        step_dir = store.paths.step_dir(1)
        assert not os.path.exists(step_dir) or os.listdir(step_dir) == []
        assert store.inventory.complete_steps() == []
        assert store.capacity.usage_bytes() == before[1]
        assert store.gc() == []
    finally:
        store.close()


# ---------------------------------------------------------------- a real, small tmpfs

@pytest.fixture
def small_tmpfs(store_dir):
    with mounted_tmpfs(os.path.join(store_dir, "small"), "size=8m,mode=0700") as mnt:
        yield mnt


def test_full_tmpfs_raises_capacity_error_and_keeps_checkpoints(small_tmpfs):
    with limited_manager(small_tmpfs, None, keep=2) as ckpt:
        ckpt.save(state(1, mib=3), 1)
        ckpt.save(state(2, mib=3), 2)
        used = internals(ckpt).store.capacity.usage_bytes()
        with pytest.raises(CapacityError) as ei:
            ckpt.save(state(3, mib=3), 3)  # 9 MiB would be needed on an 8 MiB tmpfs
        check_message(ei.value)
        assert small_tmpfs in str(ei.value)
        with pytest.raises(CapacityError):
            ckpt.async_save(state(3, mib=3), 3).result(timeout=60)
        ckpt.wait()
        assert internals(ckpt).store.inventory.complete_steps() == [1, 2]
        assert internals(ckpt).store.capacity.usage_bytes() == used
        for s in (1, 2):
            internals(ckpt).store.verify_shard(s, 0)
    with limited_manager(small_tmpfs, None, keep=2) as ckpt:
        out = zeros(3)
        info = ckpt.resume(out)
        assert (info.step, info.source) == (2, "local")
        assert torch.equal(out["w"], state(2, mib=3)["w"])
        # a checkpoint that fits still goes in
        ckpt.save(state(3, mib=0.5), 3)
        assert internals(ckpt).store.inventory.complete_steps()[-1] == 3


# ---------------------------------------------------------------- what the message suggests
# Only what can make room: the size needed when one save is larger than all the room there is,
# a lower keep= only when the steps it would retire hold enough.

def test_a_shard_larger_than_the_whole_tmpfs_names_the_size_it_needs(small_tmpfs):
    with limited_manager(small_tmpfs, None, keep=2) as ckpt, pytest.raises(CapacityError) as ei:
        ckpt.save(state(1, mib=12), 1)
    msg = str(ei.value)
    assert "one save is larger than its 8.0 MiB filesystem: enlarge the tmpfs to at least " \
        "12.0 MiB" in msg and small_tmpfs in msg, msg
    assert "keep=" not in msg and "replicas=" not in msg, msg  # neither could help


def test_keep_is_suggested_when_fewer_kept_steps_would_make_room(small_tmpfs):
    with limited_manager(small_tmpfs, None, keep=2) as ckpt:
        ckpt.save(state(1, mib=3), 1)
        ckpt.save(state(2, mib=3), 2)
        with pytest.raises(CapacityError) as ei:
            ckpt.save(state(3, mib=3), 3)  # keep=1 would have retired step 1's 3 MiB
    msg = str(ei.value)
    assert "enlarge the tmpfs, lower keep= (this node's older steps hold 3.0 MiB)" in msg, msg
    assert "larger than" not in msg and "free space on it" not in msg, msg


def test_room_another_program_holds_is_named_and_keep_is_not(small_tmpfs):
    with open(os.path.join(small_tmpfs, "other-program"), "wb") as f:
        os.posix_fallocate(f.fileno(), 0, 4 * MiB)
    with limited_manager(small_tmpfs, None, keep=2) as ckpt:
        ckpt.save(state(1, mib=2.5), 1)
        with pytest.raises(CapacityError) as ei:
            ckpt.save(state(2, mib=2.5), 2)  # no older step to retire: keep= cannot help
    msg = str(ei.value)
    assert "free space on it (other programs use it; keeping fewer steps would give back " \
        "only 0.0 MiB)" in msg, msg
    assert "keep=" not in msg and "larger than" not in msg, msg


def test_a_memory_limit_smaller_than_one_save_names_the_limit_it_needs(store_dir):
    with (limited_manager(os.path.join(store_dir, "local"), MiB, keep=2) as ckpt,
          pytest.raises(CapacityError) as ei):
        ckpt.save(state(1, mib=2), 1)
    msg = str(ei.value)
    assert "one save is larger than the whole limit: raise memory_limit_bytes " \
        "(MLCHECKPOINT_MEMORY_LIMIT) to at least 2.0 MiB" in msg, msg
    assert "keep=" not in msg, msg


def test_a_memory_limit_that_holds_fewer_steps_suggests_keep(store_dir):
    limit = 2 * usage_after_one_save(store_dir) + 256 * 1024  # two steps, not three
    with limited_manager(os.path.join(store_dir, "local"), limit, keep=2) as ckpt:
        ckpt.save(state(1), 1)
        ckpt.save(state(2), 2)
        with pytest.raises(CapacityError) as ei:
            ckpt.save(state(3), 3)
    msg = str(ei.value)
    assert "raise memory_limit_bytes (MLCHECKPOINT_MEMORY_LIMIT) or lower keep= (this node's " \
        "older steps hold 1.0 MiB)" in msg, msg

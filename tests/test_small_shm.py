"""A container's default 64 MiB /dev/shm (issue 24, item 2), on a real tmpfs of that size.

The manager says at construction that such a filesystem is small, and at the first save,
once a shard's size is known, that it cannot hold ``keep`` steps: one line that names the
setting to raise (`--shm-size`, the emptyDir's `sizeLimit`, a hostPath tmpfs).
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
from helpers import mounted_tmpfs

from mlcheckpoint import CheckpointManager
from mlcheckpoint.errors import CapacityError
from mlcheckpoint.tmpfs import needed_bytes

MiB = 1 << 20
JOB = "small-shm"


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "mlcheckpoint.tmpfs" and r.levelno == logging.WARNING]


def _save_twice(local_dir: str, mib: int) -> None:
    """Two saves of a ``mib`` MiB state with keep=2; the second may not fit."""
    state = {"w": torch.ones(mib * MiB // 4, dtype=torch.float32)}
    with CheckpointManager(job_id=JOB, local_dir=local_dir, keep=2, replication="none") as ckpt:
        ckpt.save(state, 1)
        ckpt.async_save(state, 2).result()


def test_docker_default_shm_is_reported_at_start(store_dir, clean_env, caplog):
    caplog.set_level(logging.WARNING, logger="mlcheckpoint.tmpfs")
    with mounted_tmpfs(os.path.join(store_dir, "shm"), "size=64m,mode=0700") as shm:
        _save_twice(shm, mib=24)  # 2 steps of 24 MiB fit in 64 MiB: no word at the first save
    (start,) = _warnings(caplog)
    assert shm in start and "64 MiB filesystem (the size of a container's default /dev/shm)" in start
    assert "holds keep=2 steps of this node's 1 rank only for shards under 32.0 MiB per rank" in start
    _names_the_settings(start)


def test_a_first_save_that_cannot_be_kept_is_reported(store_dir, clean_env, caplog):
    caplog.set_level(logging.WARNING, logger="mlcheckpoint.tmpfs")
    with (mounted_tmpfs(os.path.join(store_dir, "shm"), "size=64m,mode=0700") as shm,
          pytest.raises(CapacityError)):  # what the line foretold: step 2 does not fit
        _save_twice(shm, mib=40)
    _start, first_save = _warnings(caplog)  # once, at the first save, not again at the second
    assert f"{shm} is on a 64 MiB filesystem, too small for keep=2 steps of this node's 1 rank: " \
        "about 80 MiB with 40.0 MiB per rank and step" in first_save
    _names_the_settings(first_save)


def _names_the_settings(line: str) -> None:
    assert line.startswith("mlcheckpoint: ") and "\n" not in line
    assert "--shm-size" in line and "sizeLimit" in line and "hostPath tmpfs" in line


def test_a_larger_tmpfs_says_nothing(store_dir, clean_env, caplog):
    caplog.set_level(logging.WARNING, logger="mlcheckpoint.tmpfs")
    with mounted_tmpfs(os.path.join(store_dir, "shm"), "size=160m,mode=0700") as shm:
        _save_twice(shm, mib=24)
    assert _warnings(caplog) == []


def test_replicas_of_the_partner_count_as_much_as_the_node_own_shards():
    assert needed_bytes(10 * MiB, keep=2, ranks_per_node=4, replicating=False) == 80 * MiB
    assert needed_bytes(10 * MiB, keep=2, ranks_per_node=4, replicating=True) == 160 * MiB


def test_what_replicas_bring_counts_where_it_is_known():
    """With data parallelism's copies a partner's replica holds only its per-rank state: the
    node needs room for that, not for a second shard of its own size."""
    assert needed_bytes(10 * MiB, keep=2, ranks_per_node=4, replicating=True,
                        arriving=MiB // 2) == 84 * MiB
    assert needed_bytes(10 * MiB, keep=2, ranks_per_node=4, replicating=True, replica_sets=2,
                        arriving=None) == 240 * MiB

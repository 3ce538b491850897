"""``CheckpointManager.stats()``: the figures a training loop logs beside its loss, taken from
what the library itself reports (SaveResult, protection(), ResumeInfo), in one process."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from helpers import mounted_tmpfs

from mlcheckpoint import CheckpointManager

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
JOB = "job-metrics"


def test_stats_give_the_last_save_and_the_last_resume_as_numbers(store_dir, clean_env):
    local = os.path.join(store_dir, "mem")
    state = {"w": torch.arange(4096, dtype=torch.float32), "step": 0}
    with CheckpointManager(job_id=JOB, local_dir=local, replication="none") as ckpt:
        fresh = ckpt.stats()
        assert not any(k.startswith(("mlcheckpoint/save_", "mlcheckpoint/resume_")) for k in fresh)
        assert "mlcheckpoint/protected_step" not in fresh  # None is left out, not logged
        first = ckpt.save(state, 1)
        assert ckpt.stats()["mlcheckpoint/save_step"] == 1
        second = ckpt.async_save(state, 2).result()
        stats = ckpt.stats()
    assert all(k.startswith("mlcheckpoint/") and isinstance(v, float) for k, v in stats.items())
    assert stats["mlcheckpoint/save_step"] == 2 and second.step == 2 and first.step == 1
    assert stats["mlcheckpoint/save_seconds"] == second.seconds
    assert stats["mlcheckpoint/save_blocking_seconds"] == second.blocking_seconds
    assert stats["mlcheckpoint/save_bytes"] == second.bytes > 4096 * 4 - 1
    for phase in ("stage", "commit", "publish"):
        assert stats[f"mlcheckpoint/save_{phase}_seconds"] == second.phases[phase] >= 0
    assert stats["mlcheckpoint/superseded_saves"] == 0  # replication off: nothing protected
    assert stats["mlcheckpoint/guard_longest_wait_seconds"] == 0.0  # no guard: never held
    assert "mlcheckpoint/protected_step" not in stats

    # A restarted job is a fresh manager: its stats carry the resume, not a save.
    with CheckpointManager(job_id=JOB, local_dir=local, replication="none") as restarted:
        loaded = {"w": torch.zeros(4096), "step": -1}
        info = restarted.resume(loaded)
        stats = restarted.stats()
    assert info.step == 2 and loaded["step"] == 0
    assert stats["mlcheckpoint/resume_step"] == 2
    assert stats["mlcheckpoint/resume_seconds"] == info.seconds
    assert set(info.phases) == {"inventory", "plan", "fetch", "verify", "load", "heal"}
    for phase, seconds in info.phases.items():
        assert stats[f"mlcheckpoint/resume_{phase}_seconds"] == seconds
    assert not any(k.startswith("mlcheckpoint/save_") for k in stats)


def test_failed_saves_are_logged_once_counted_and_their_persistent_step_still_written(
        store_dir, clean_env, caplog):
    """Issue 42, in one process on an 8 MiB tmpfs another program fills: three RAM saves fail
    (one ERROR line, then counted), the persistent step asked for among them is written all
    the same, and one line says when saves succeed again."""
    caplog.set_level(logging.INFO, logger="mlcheckpoint.manager")
    folder = os.path.join(store_dir, "persistent")
    state = {"w": torch.arange(2**20, dtype=torch.float32)}  # 4 MiB
    with mounted_tmpfs(os.path.join(store_dir, "shm"), "size=8m,mode=0700") as shm:
        filler = os.path.join(shm, "other-program")
        with open(filler, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, 6 * 2**20)
        with CheckpointManager(folder, job_id=JOB, local_dir=shm, keep=1,
                               replication="none") as ckpt:
            errors = [ckpt.async_save(state, step, persistent=step == 1).exception()
                      for step in range(3)]
            os.unlink(filler)
            assert ckpt.async_save(state, 3).exception() is None
            stats = ckpt.stats()
    assert [type(e).__name__ for e in errors] == ["CapacityError"] * 3
    assert str(errors[1]).endswith("; step 1: persistent checkpoint written instead")
    assert os.path.exists(os.path.join(folder, "step-000000000001", ".metadata"))
    assert (stats["mlcheckpoint/failed_saves"], stats["mlcheckpoint/failed_saves_in_a_row"]) == (3, 0)
    said = [(r.levelname, r.getMessage()) for r in caplog.records if r.name.endswith("saving")]
    assert [level for level, _ in said] == ["ERROR", "WARNING"], said
    assert "async save of step 0 failed" in said[0][1] and "counted in stats()" in said[0][1]
    assert said[1][1] == ("mlcheckpoint: RAM saves succeed again after 3 failures (failing since "
                          "step 0; step 3 saved)")


def test_stats_give_where_replications_time_went():
    """``replication``: the replicator's profile (issue 45), each figure as
    ``replication_<key>``; left out with replication off."""
    from mlcheckpoint.manager import metrics
    from mlcheckpoint.replication.schedule.status import ProtectionStatus

    protection = ProtectionStatus(None, None, None, None, None, 0)
    profile = {"sent_bytes": 10, "send_seconds": 0.5, "budget_wait_seconds": 2.0,
               "received_replicas": 1, "verify_seconds": 0.1}
    stats = metrics.stats(None, protection, None, replication=profile)
    assert {k: stats[f"mlcheckpoint/replication_{k}"] for k in profile} == profile
    off = metrics.stats(None, protection, None)
    assert "mlcheckpoint/replication_sent_bytes" not in off

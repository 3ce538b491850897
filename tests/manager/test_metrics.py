"""``CheckpointManager.stats()``: the figures a training loop logs beside its loss, taken from
what the library itself reports (SaveResult, protection(), ResumeInfo), in one process."""

from __future__ import annotations

import os

import pytest
import torch

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

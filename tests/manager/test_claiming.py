"""One live run per job directory, as a CheckpointManager takes it (manager/claiming.py), in one
process with no process group: a second manager on the directory of a live one is refused
naming it and changes nothing; a restart with another persistent folder is refused naming both
unless MLCHECKPOINT_PERSISTENT_DIR_MOVED=1. Every rank of real jobs: tests/jobs/test_job_claim.py;
the claim itself: tests/store/test_claim.py."""

from __future__ import annotations

import gc
import logging
import os
import socket

import pytest
from helpers import snapshot
from states import assert_same, make_state, zeros_like_state

from mlcheckpoint import CheckpointManager, ConfigError, JobDirInUseError

# DCP warns that it assumes a single process when no process group is initialised.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

JOB = "claimed-job"


def manager(store_dir: str, persistent: str = "persistent-a") -> CheckpointManager:
    return CheckpointManager(os.path.join(store_dir, persistent), job_id=JOB,
                             local_dir=os.path.join(store_dir, "local"), replication="none", keep=2)


def test_a_second_run_on_a_live_runs_directory_is_refused_and_changes_nothing(store_dir, clean_env):
    first = manager(store_dir)
    try:
        for step in (0, 1, 2):
            first.save(make_state(step), step)
        job_dir = os.path.join(store_dir, "local", JOB)
        before = snapshot(job_dir)
        with pytest.raises(JobDirInUseError) as refused:
            manager(store_dir, "persistent-b")
        said = str(refused.value)
        for words in (job_dir, f"host {socket.gethostname()}", f"pid {os.getpid()}", "started ",
                      f"persistent_dir {os.path.join(store_dir, 'persistent-a')}",
                      "MLCHECKPOINT_JOB_ID", "MLCHECKPOINT_LOCAL_DIR", "local_dir="):
            assert words in said, (words, said)
        assert isinstance(refused.value, ConfigError)
        with pytest.raises(JobDirInUseError):  # also with the same persistent folder
            manager(store_dir)
        assert snapshot(job_dir) == before  # no gc, no set-aside, no retention, no record
        first.save(make_state(3), 3)  # the first run goes on saving
        assert [e.step for e in first.checkpoints()] == [2, 3]
    finally:
        first.close()
    with manager(store_dir) as restart:  # closed: its restart claims the directory
        out = zeros_like_state(make_state())
        assert restart.resume(out).step == 3
        assert_same(make_state(3), out)


def test_another_persistent_folder_is_refused_naming_both_unless_the_move_is_accepted(
        store_dir, clean_env, caplog):
    with manager(store_dir) as first:
        first.save(make_state(5), 5)
    a, b = (os.path.join(store_dir, p) for p in ("persistent-a", "persistent-b"))
    with pytest.raises(ConfigError) as refused:
        manager(store_dir, "persistent-b")
    said = str(refused.value)
    assert not isinstance(refused.value, JobDirInUseError)
    for words in ("holds step 5", f"persistent_dir was {a}", f"this run's persistent_dir is {b}",
                  "MLCHECKPOINT_JOB_ID", "MLCHECKPOINT_PERSISTENT_DIR_MOVED=1"):
        assert words in said, (words, said)
    clean_env.setenv("MLCHECKPOINT_PERSISTENT_DIR_MOVED", "1")
    caplog.set_level(logging.WARNING, logger="mlcheckpoint")
    with manager(store_dir, "persistent-b") as moved:
        out = zeros_like_state(make_state())
        assert moved.resume(out).step == 5
        assert_same(make_state(5), out)
    warned = [r.getMessage() for r in caplog.records if "MLCHECKPOINT_PERSISTENT_DIR_MOVED" in r.getMessage()]
    assert len(warned) == 1 and a in warned[0] and b in warned[0], warned
    clean_env.delenv("MLCHECKPOINT_PERSISTENT_DIR_MOVED")
    with manager(store_dir, "persistent-b") as later:  # the directory now records the new folder
        assert later.resume(zeros_like_state(make_state())).step == 5
    with pytest.raises(ConfigError, match="MLCHECKPOINT_PERSISTENT_DIR_MOVED"):
        manager(store_dir, "persistent-a")


def test_a_manager_that_is_dropped_or_closed_after_a_failure_frees_the_directory(store_dir, clean_env):
    first = manager(store_dir)
    first.save(make_state(1), 1)
    first.close(failed=True)  # a rank that raised; the process goes on and builds another
    with manager(store_dir) as again:
        assert again.resume(zeros_like_state(make_state())).step == 1
    manager(store_dir)  # never closed, and dropped: collected, it holds nothing
    gc.collect()
    with manager(store_dir) as last:
        assert last.resume(zeros_like_state(make_state())).step == 1


def test_a_claim_the_os_refuses_is_a_config_error_not_a_hang(store_dir, clean_env):
    os.makedirs(os.path.join(store_dir, "local", JOB, "claim.json"))  # not a file
    with pytest.raises(ConfigError, match="could not claim job directory .* on node 0"):
        manager(store_dir)

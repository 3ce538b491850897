"""Mistakes a new user makes on a restart, in one process (no process group): a job id that
finds nothing while other jobs under local_dir hold steps, what ``ResumeInfo.reason`` says,
and saving before ``resume``. On two real nodes: tests/jobs/test_first_week_jobs.py."""

from __future__ import annotations

import contextlib
import logging
import os
import time

import pytest
import torch.distributed.checkpoint as dcp
from helpers import damage_shard
from states import assert_same, make_state, zeros_like_state

from mlcheckpoint import CheckpointManager
from mlcheckpoint.testing import internals

# DCP warns that it assumes a single process when no process group is initialised.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def manager(store_dir: str, job_id: str, **kw) -> CheckpointManager:
    return CheckpointManager(os.path.join(store_dir, "persistent"), job_id=job_id,
                             local_dir=os.path.join(store_dir, "local"), replication="none", **kw)


@contextlib.contextmanager
def no_logging_set_up():
    """The logging of a script that never configured it: no handler anywhere (pytest's capture
    handlers on the root logger taken off meanwhile), root level WARNING. Only Python's handler
    of last resort can then print; it writes to sys.stderr (capsys reads it)."""
    loggers = [logging.root] + [logging.getLogger(n) for n in list(logging.root.manager.loggerDict)
                                if n.startswith("mlcheckpoint")]
    saved = [(lg, lg.handlers, lg.level) for lg in loggers]
    try:
        for lg in loggers:
            lg.handlers = []
            lg.setLevel(logging.WARNING if lg is logging.root else logging.NOTSET)
        yield
    finally:
        for lg, handlers, level in saved:
            lg.handlers = handlers
            lg.setLevel(level)


def first_run(store_dir: str) -> None:
    """The first run: MLCHECKPOINT_JOB_ID=newcomer-job, persistent step 35, then 38 and 39;
    then it fails (a clean close would make it a finished job, which no warning names)."""
    ckpt = manager(store_dir, "newcomer-job", keep=2)
    for step in (35, 38, 39):
        ckpt.save(make_state(step), step, persistent=step == 35)
    ckpt.close(failed=True)


def test_a_restart_under_another_job_id_warns_naming_the_jobs_and_the_setting(
        store_dir, capsys):
    first_run(store_dir)
    # The restart forgot the id: one derived from the persistent folder (dir-<hash>).
    with manager(store_dir, "dir-c091df387f84fa04") as ckpt:
        out = zeros_like_state(make_state())
        with no_logging_set_up():
            info = ckpt.resume(out)
    assert (info.step, info.source) == (35, "persistent")
    assert_same(make_state(35), out)
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if "newcomer-job" in line]
    assert len(warnings) == 1, err  # once, visible with no logging set up
    for words in ("no step of job 'dir-c091df387f84fa04'", "newcomer-job (newest step 39",
                  "MLCHECKPOINT_JOB_ID", "job_id=", "loads persistent step 35"):
        assert words in warnings[0], (words, warnings[0])
    # The reason tells the truth: memory had nothing of this job, persistent was loaded.
    for words in ("memory holds no checkpoint of this job", "loading persistent step 35",
                  "newcomer-job (newest step 39", "MLCHECKPOINT_JOB_ID"):
        assert words in info.reason, (words, info.reason)
    assert "no checkpoint found" not in info.reason
    # The other job's files are only listed, never touched.
    with manager(store_dir, "newcomer-job") as ckpt:
        assert [e.step for e in ckpt.checkpoints() if e.location == "memory"] == [38, 39]


def test_a_fresh_start_next_to_another_job_warns_too(store_dir, capsys):
    ckpt = manager(store_dir, "newcomer-job")
    ckpt.save(make_state(3), 3)
    ckpt.close(failed=True)  # it may be resumed yet
    with CheckpointManager(job_id="other", local_dir=os.path.join(store_dir, "local"),
                           replication="none") as ckpt, no_logging_set_up():
        info = ckpt.resume(zeros_like_state(make_state()))
    assert info.step is None
    err = capsys.readouterr().err
    assert err.count("newcomer-job (newest step 3, on node 0)") == 1, err
    assert "This run starts fresh" in err
    assert "starting fresh" in info.reason and "newcomer-job" in info.reason, info.reason


def test_no_warning_when_memory_holds_this_job_or_no_other_job(store_dir, capsys):
    with manager(store_dir, "job-a") as ckpt:
        ckpt.save(make_state(2), 2, persistent=True)
    with manager(store_dir, "job-b") as ckpt:
        ckpt.save(make_state(5), 5)
    with manager(store_dir, "job-a") as ckpt, no_logging_set_up():  # its own step 2 is here
        info = ckpt.resume(zeros_like_state(make_state()))
    assert (info.step, info.source, info.reason) == (2, "local", None)
    with manager(os.path.join(store_dir, "alone"), "job-c") as ckpt, no_logging_set_up():
        info = ckpt.resume(zeros_like_state(make_state()))
    assert info.step is None and "job-" not in info.reason
    assert "job-b" not in capsys.readouterr().err


def test_a_finished_job_is_named_only_as_memory_to_reclaim(store_dir, capsys):
    """Issue 44: close() after the last step marks the job finished on this node. Another job's
    resume does not name it among the jobs it might have meant; LocalStore.finished_jobs (what a
    short room names first) does; a new run of the job takes the mark away."""
    with manager(store_dir, "done-job") as ckpt:  # a clean finish
        ckpt.save(make_state(7), 7)
    done = os.path.join(store_dir, "local", "done-job")
    assert os.path.exists(os.path.join(done, "finished.json"))
    unfinished = manager(store_dir, "crashed-job")
    unfinished.save(make_state(4), 4)
    unfinished.close(failed=True)
    with CheckpointManager(job_id="third", local_dir=os.path.join(store_dir, "local"),
                           replication="none") as ckpt, no_logging_set_up():
        info = ckpt.resume(zeros_like_state(make_state()))
        finished = internals(ckpt).store.finished_jobs()
    err = capsys.readouterr().err
    assert "crashed-job (newest step 4" in err and "done-job" not in err, err
    assert "done-job" not in info.reason, info.reason
    assert list(finished) == ["done-job"] and finished["done-job"] > 0, finished
    # Run again, the job is no longer finished; it resumes its step as before.
    with manager(store_dir, "done-job") as ckpt:
        assert not os.path.exists(os.path.join(done, "finished.json"))
        assert ckpt.resume(zeros_like_state(make_state())).step == 7
        ckpt.close(failed=True)
    assert not os.path.exists(os.path.join(done, "finished.json"))


def test_persistent_loaded_because_memory_is_unusable_says_why(store_dir):
    with manager(store_dir, "job") as ckpt:
        ckpt.save(make_state(4), 4, persistent=True)
        ckpt.save(make_state(6), 6)
        damage_shard(internals(ckpt).store, 6, 0, "truncated")  # listed as damaged
        damage_shard(internals(ckpt).store, 4, 0, item=0, at=0)  # found when it is loaded
    with manager(store_dir, "job") as ckpt:
        out = zeros_like_state(make_state())
        info = ckpt.resume(out)
    assert (info.step, info.source) == (4, "persistent")
    assert_same(make_state(4), out)
    for words in ("step 6 unusable", "truncated", "checksum mismatch",
                  "no step in memory is usable: loading persistent step 4"):
        assert words in info.reason, (words, info.reason)


# ---------------------------------------------------------------------------- saving before resume
def earlier_run(store_dir: str) -> None:
    """A run of the job that saved steps 3, 4 and 5 (keep=2: 4 and 5 stay in memory), step 3
    also to the persistent folder, a minute ago (a restart takes that long)."""
    with manager(store_dir, "job") as ckpt:
        for step in (3, 4, 5):
            ckpt.save(make_state(100 + step), step, persistent=step == 3)
        folder = internals(ckpt).persistent.path(3)
    then = time.time() - 60
    os.utime(folder, (then, then))


def memory_steps(ckpt: CheckpointManager) -> list[int]:
    return [e.step for e in ckpt.checkpoints() if e.location == "memory"]


SAVES = {
    "save": lambda ckpt, sd, step: ckpt.save(sd, step),
    "async_save": lambda ckpt, sd, step: ckpt.async_save(sd, step).result(timeout=60),
    "dcp": lambda ckpt, sd, step: dcp.save(sd, storage_writer=ckpt.storage_writer(step)),
}


@pytest.mark.parametrize("how", list(SAVES))
def test_saving_before_resume_sets_the_earlier_run_aside(store_dir, capsys, how):
    earlier_run(store_dir)
    with manager(store_dir, "job") as ckpt, no_logging_set_up():  # the restart skips resume
        for step in (0, 1):
            SAVES[how](ckpt, make_state(step), step)
        # This run's saves are kept: the earlier run's numerically newer 4 and 5 do not crowd
        # them out of retention.
        assert memory_steps(ckpt) == [0, 1]
        # Set aside, not deleted.
        assert [step for step, _ in internals(ckpt).store.orphans()] == [4, 5]
    err = capsys.readouterr().err
    warned = [line for line in err.splitlines() if "did not call resume()" in line]
    assert len(warned) == 1, err  # one warning, visible with no logging set up
    assert "step 0 is the first save" in warned[0] and "steps 4, 5" in warned[0], warned
    assert "orphans" in warned[0] and "resume(state_dict) before the first save" in warned[0]
    # A later resume loads this run's step 1, never the earlier run's step 5, nor its
    # persistent step 3 (numerically newer, but written before step 1 was saved).
    with manager(store_dir, "job") as ckpt:
        out = zeros_like_state(make_state())
        info = ckpt.resume(out)
    assert (info.step, info.source) == (1, "local"), info
    assert_same(make_state(1), out)
    assert "persistent step 3 was written before memory step 1 was saved" in info.reason


def test_a_run_that_resumed_sets_nothing_aside(store_dir, capsys):
    earlier_run(store_dir)
    with manager(store_dir, "job") as ckpt, no_logging_set_up():
        info = ckpt.resume(zeros_like_state(make_state()))
        assert info.step == 5
        ckpt.save(make_state(6), 6)
        assert memory_steps(ckpt) == [5, 6] and internals(ckpt).store.orphans() == []
    assert "did not call resume()" not in capsys.readouterr().err


def test_set_aside_steps_go_once_the_new_run_has_a_newer_complete_step(store_dir):
    earlier_run(store_dir)
    with manager(store_dir, "job") as ckpt:
        for step in range(7):
            ckpt.save(make_state(step), step)
            left = [s for s, _ in internals(ckpt).store.orphans()]
            assert left == [s for s in (4, 5) if s >= step], (step, left)
        assert memory_steps(ckpt) == [5, 6]


def test_an_earlier_runs_persistent_step_stays_out_whatever_the_file_servers_clock_says(store_dir):
    """The persistent folder's clock (a file server's) runs a minute ahead: by the folder's
    time the earlier run's persistent step 3 looks written after this run's saves. The run
    that wrote it is recorded beside it, so the resume still knows it for an earlier history."""
    earlier_run(store_dir)
    with manager(store_dir, "job") as ckpt:
        ahead = time.time() + 60
        os.utime(internals(ckpt).persistent.path(3), (ahead, ahead))
        origin = internals(ckpt).persistent.origin(3)
        assert origin is not None and origin.run_id  # the earlier run wrote it
        for step in (0, 1):
            ckpt.save(make_state(step), step)
    with manager(store_dir, "job") as ckpt:
        out = zeros_like_state(make_state())
        info = ckpt.resume(out)
    assert (info.step, info.source) == (1, "local"), info
    assert_same(make_state(1), out)
    assert "belongs to an earlier history" in info.reason


def test_a_damaged_origin_record_falls_back_to_the_folders_time(store_dir):
    earlier_run(store_dir)  # the folder's time: a minute before this run's saves
    with manager(store_dir, "job") as ckpt:
        with open(os.path.join(internals(ckpt).persistent.path(3), ".mlcheckpoint-origin.json"), "w") as f:
            f.write("{not json")
        assert internals(ckpt).persistent.origin(3) is None
        for step in (0, 1):
            ckpt.save(make_state(step), step)
    with manager(store_dir, "job") as ckpt:
        info = ckpt.resume(zeros_like_state(make_state()))
    assert (info.step, info.source) == (1, "local"), info

"""Worker: a run of a job that claims its job directory (tests/jobs/test_job_claim.py), on
every rank. Saves with ``save`` (committed on every rank when it returns), replication off.

argv: phase tag [args]
  train TAG LAST HOLD  resume, report "resumed-TAG" {step, source, match, pid}; save each step
                       after the resumed one up to LAST; after saving step HOLD report
                       "held-TAG" {pid} and wait until the file <TEST_OUT_DIR>/go-TAG exists;
                       at the end report "done-TAG" {memory: in-memory steps, orphans}
  second TAG           build a manager and report "second-TAG" {error: its type's name or
                       None, message, seconds: how long the constructor took}
"""

import os
import sys
import time

import torch.distributed as dist
from common import init, report
from states import differences, make_state, zeros_like_state

from mlcheckpoint import CheckpointManager, MLCheckpointError
from mlcheckpoint.testing import internals


def manager() -> CheckpointManager:
    return CheckpointManager(persistent_dir=os.environ["TEST_PERSISTENT_DIR"], keep=2,
                             replication="none")


def train(tag: str, last: int, hold: int, rank: int) -> None:
    ckpt = manager()
    sd = zeros_like_state(make_state(0, rank))
    info = ckpt.resume(sd)
    match = info.step is None or not differences(make_state(info.step, rank), sd)
    report(f"resumed-{tag}", {"step": info.step, "source": info.source, "match": match,
                              "pid": os.getpid()})
    go = os.path.join(os.environ["TEST_OUT_DIR"], f"go-{tag}")
    for step in range(0 if info.step is None else info.step + 1, last + 1):
        ckpt.save(make_state(step, rank), step)
        if step == hold:
            report(f"held-{tag}", {"pid": os.getpid()})
            while not os.path.exists(go):
                time.sleep(0.05)
    report(f"done-{tag}", {"memory": [e.step for e in ckpt.checkpoints() if e.location == "memory"],
                           "orphans": [s for s, _ in internals(ckpt).store.orphans()]})
    ckpt.close()


def second(tag: str) -> None:
    t0 = time.monotonic()
    error, message = None, ""
    try:
        ckpt = manager()
    except MLCheckpointError as e:  # what the test is about: every rank's error
        error, message = type(e).__name__, str(e)
    else:
        ckpt.close()
    report(f"second-{tag}", {"error": error, "message": message,
                             "seconds": time.monotonic() - t0})


def main() -> None:
    phase, tag = sys.argv[1], sys.argv[2]
    rank, _ = init()
    if phase == "train":
        train(tag, int(sys.argv[3]), int(sys.argv[4]), rank)
    elif phase == "second":
        second(tag)
    else:
        raise ValueError(phase)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

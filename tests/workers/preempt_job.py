"""Worker for tests/jobs/test_preemption.py: a job preempted whole (issue 42, item 5).

argv[1]:
- ``train``: a RAM save every step, a persistent one every 10 (``async_save``), a training
  collective on the default group each step, until SIGTERM (300 steps at most). Each step
  reports ``progress`` (the step saved, the newest protected step). Ranks listed in
  ``TEST_USER_HANDLER`` install a SIGTERM handler of their own before the manager: it reports
  ``user_handler``, takes ``TEST_HANDLER_SECONDS`` (default 0) and raises SystemExit, as a
  training script's would. With
  ``TEST_STALL_FILE``: once that file exists the last rank stops taking part (it sleeps), so
  the others block in the training collective: their main thread never runs a Python handler.
- ``resume``: resume into an empty state, report ``resume`` (step, source, exact or not).
- ``resume_hold``: the same, then wait for SIGTERM without saving (a job preempted again
  before its first step after a restart), 120 s at most.
"""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from common import init, report
from states import differences, make_state, zeros_like_state

from mlcheckpoint import CheckpointManager

MAX_STEPS = 300


def train(rank: int, world: int) -> None:
    if str(rank) in os.environ.get("TEST_USER_HANDLER", "").split(","):
        def handler(signum, frame):
            report("user_handler", {"rank": rank, "signal": signum})
            time.sleep(float(os.environ.get("TEST_HANDLER_SECONDS", "0")))  # its own cleanup
            raise SystemExit(128 + signum)
        signal.signal(signal.SIGTERM, handler)
    stall = os.environ.get("TEST_STALL_FILE")
    ckpt = CheckpointManager(persistent_dir=os.environ["TEST_PERSISTENT_DIR"])
    ckpt.resume(zeros_like_state(make_state(0, rank)))
    for step in range(MAX_STEPS):
        while stall and rank == world - 1 and os.path.exists(stall):
            time.sleep(0.05)  # gone quiet: the others wait for it in all_reduce
        dist.all_reduce(torch.ones(1))  # the training step's collective
        ckpt.async_save(make_state(step, rank), step, persistent=step % 10 == 0).result()
        report("progress", {"step": step, "protected": ckpt.protection().newest_protected})
        time.sleep(0.05)
    ckpt.close()


def resume(rank: int, hold: bool) -> None:
    ckpt = CheckpointManager(persistent_dir=os.environ["TEST_PERSISTENT_DIR"])
    sd = zeros_like_state(make_state(0, rank))
    info = ckpt.resume(sd)
    mismatch = [] if info.step is None else differences(make_state(info.step, rank), sd)
    report("resume", {"step": info.step, "source": info.source, "mismatch": mismatch,
                      "own": info.sources.get(rank)})
    if hold:
        time.sleep(120)  # SIGTERM ends the process (after the flush) well before
    ckpt.close()


def main() -> None:
    rank, world = init()
    if sys.argv[1] == "train":
        train(rank, world)
    else:
        resume(rank, hold=sys.argv[1] == "resume_hold")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

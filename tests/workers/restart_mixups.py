"""Worker: the restarts of a new user's first week, on every rank (with no logging set up when
TEST_NO_LOGGING_SETUP=1, as many training scripts run).

argv: phase
  first   resume (nothing there), async_save steps 0-5, step 3 also to the persistent folder;
          wait until step 5 is on both nodes (keep=2: steps 4 and 5 stay, own and replica);
          then stop as a preempted run does (not a finished job: store/claim.py)
  forgot  the job id is left unset (MLCHECKPOINT_JOB_ID empty): derived from the persistent
          folder; resume and report "forgot" {step, source, reason, job_id, match}
  skip    no resume: async_save steps 0 and 1, report "skip" {memory: in-memory steps listed,
          orphans: steps set aside on this node}
  resume  resume and report "resume" {step, source, reason, match}
"""

import os
import sys

import torch.distributed as dist
from common import init, report
from states import differences, make_state, zeros_like_state

from mlcheckpoint import CheckpointManager
from mlcheckpoint.testing import internals


def resumed(ckpt: CheckpointManager, rank: int, world: int) -> dict:
    sd = zeros_like_state(make_state(0, rank))
    info = ckpt.resume(sd)
    mismatch = [] if info.step is None else differences(make_state(info.step, rank), sd)
    return {"step": info.step, "source": info.source, "reason": info.reason,
            "job_id": ckpt.job_id, "match": not mismatch}


def main() -> None:
    phase = sys.argv[1]
    rank, world = init()
    ckpt = CheckpointManager(persistent_dir=os.environ["TEST_PERSISTENT_DIR"], keep=2)
    if phase == "first":
        resumed(ckpt, rank, world)
        for step in range(6):
            ckpt.async_save(make_state(step, rank), step, persistent=step == 3)
        ckpt.wait()
        assert ckpt.wait_replicated(5, 60)
        ckpt.close(failed=True)  # stopped before it finished: a clean close marks it finished
    elif phase in ("forgot", "resume"):
        report(phase, resumed(ckpt, rank, world))
    elif phase == "skip":
        for step in (0, 1):
            ckpt.async_save(make_state(step, rank), step).result()
        ckpt.wait()
        report("skip", {"memory": [e.step for e in ckpt.checkpoints() if e.location == "memory"],
                        "orphans": [s for s, _ in internals(ckpt).store.orphans()]})
    else:
        raise ValueError(phase)
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Worker: save asynchronously right after resume (1 node x 2 ranks).

variant fresh:  resume finds nothing (fresh start), then steps 0 and 1 are async-saved at once.
variant resave: steps 0..3 are saved, then step 3 is made what a crash before its global
                metadata leaves (shards committed, no metadata); a new CheckpointManager (the
                restarted run) resumes (step 2) and at once async-saves steps 3 and 4.
Either way a last CheckpointManager must resume the newest step exactly. No barrier follows a
resume: a training loop saves as soon as it likes. Rank 1 creates $TEST_OUT_DIR/staged once
its first save after the resume is staged (the test holds rank 0 until then). Reports
"resumed" per rank.

argv: variant
"""

import os
import sys

import torch.distributed as dist
from common import init, report
from states import differences, make_state, zeros_like_state

from mlcheckpoint import CheckpointManager
from mlcheckpoint.testing import internals


def resume(job: str, rank: int, world: int) -> tuple[CheckpointManager, dict]:
    ckpt = CheckpointManager(job_id=job)
    sd = zeros_like_state(make_state(0, rank))
    info = ckpt.resume(sd)
    mismatch = [] if info.step is None else differences(make_state(info.step, rank), sd)
    return ckpt, {"step": info.step, "source": info.source, "match": not mismatch,
                  "reason": info.reason}


def main() -> None:
    variant = sys.argv[1]
    rank, world = init()
    job = os.environ["MLCHECKPOINT_JOB_ID"]
    if variant == "resave":
        ckpt = CheckpointManager(job_id=job)
        for step in range(4):
            ckpt.save(make_state(step, rank), step)
        dist.barrier()
        if rank == 0:  # the crash: step 3's shards are committed, its metadata never written
            os.unlink(internals(ckpt).store.paths.metadata(3))
        dist.barrier()
        ckpt.close()
        steps = (3, 4)
    else:
        steps = (0, 1)

    ckpt, first = resume(job, rank, world)  # the (re)started run ...
    for step in steps:  # ... trains on and saves
        saving = ckpt.async_save(make_state(step, rank), step)
        if rank == 1 and step == steps[0]:
            # its files exist under the step's number now: rank 0 may finish its resume
            with open(os.path.join(os.environ["TEST_OUT_DIR"], "staged"), "w"):
                pass
        saving.result()
    ckpt.close()
    dist.barrier()

    ckpt, second = resume(job, rank, world)
    ckpt.close()
    report("resumed", {"first": first, "second": second})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

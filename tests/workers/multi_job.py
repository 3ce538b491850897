"""Worker: several independent jobs (job ids) in one launch, one after the other.

Each job does what save_resume.py does: resume (report "resume-<job>"), save steps
[first, last] in its mode, report its listing ("listing-<job>"). One launch then covers
several scenarios; each job has its own directory, so they do not see each other.

argv: first last spec [spec ...] ; spec = job_id:mode[:persist_every]
      mode = sync | async | dcp | dcp_async | dcp_async_process ; first > last: resume only.
Persistent checkpoints of a job go to $TEST_PERSISTENT_DIR/<job_id>. MLCHECKPOINT_CRASH_AT
applies as usual.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from common import init, report
from states import differences, make_state, zeros_like_state

from mlcheckpoint import CheckpointManager


def save(ckpt: CheckpointManager, sd: dict, step: int, mode: str, persistent: bool):
    """Start saving ``step``; return a future to wait on, or None when already done."""
    if mode == "sync":
        ckpt.save(sd, step, persistent=persistent)
        return None
    if mode == "async":  # not waited for: the next async_save waits for it, as in training
        ckpt.async_save(sd, step, persistent=persistent)
        return None
    if mode == "dcp":
        dcp.save(sd, storage_writer=ckpt.storage_writer(step), process_group=ckpt.process_group)
        return None
    if mode == "dcp_async":
        return dcp.async_save(sd, storage_writer=ckpt.storage_writer(step),
                              process_group=ckpt.process_group)
    if mode == "dcp_async_process":
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
        return dcp.async_save(sd, storage_writer=ckpt.storage_writer(step),
                              process_group=ckpt.process_group,
                              async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    raise ValueError(mode)


def scribble(obj) -> None:
    """Change every value of a state dict in place, as training would."""
    if isinstance(obj, torch.Tensor):
        obj.add_(1)
    elif isinstance(obj, dict):
        for k in list(obj):
            if isinstance(obj[k], (int, float, str)):
                obj[k] = None
            else:
                scribble(obj[k])
    elif isinstance(obj, list):
        obj.append(-1.0)


def run_job(job_id: str, mode: str, persist_every: int, first: int, last: int,
            rank: int, world: int) -> None:
    persistent_dir = os.path.join(os.environ["TEST_PERSISTENT_DIR"], job_id) if persist_every else None
    ckpt = CheckpointManager(persistent_dir=persistent_dir, job_id=job_id)
    sd = zeros_like_state(make_state(0, rank))
    info = ckpt.resume(sd)
    mismatch = [] if info.step is None else differences(make_state(info.step, rank), sd)
    report(f"resume-{job_id}", {"step": info.step, "source": info.source, "match": not mismatch,
                                "mismatch": mismatch, "reason": info.reason})
    # No rank starts saving before every rank has finished resuming: resume's cleanup of
    # newer steps races with a save staged at once (resume_resave.py reproduces that bug;
    # the scenarios here test other things).
    dist.barrier()
    for step in range(first, last + 1):
        sd = make_state(step, rank)
        fut = save(ckpt, sd, step, mode, bool(persist_every) and step % persist_every == 0)
        # Change the live state right after the call, before the save is waited for: a correct
        # async save already holds its own copy.
        scribble(sd)
        if fut is not None:
            fut.result()
    ckpt.wait()
    report(f"listing-{job_id}", {"entries": [e.__dict__ for e in ckpt.checkpoints()]})
    ckpt.close()


def main() -> None:
    first, last = int(sys.argv[1]), int(sys.argv[2])
    rank, world = init()
    for spec in sys.argv[3:]:
        job_id, mode, *rest = spec.split(":")
        run_job(job_id, mode, int(rest[0]) if rest else 0, first, last, rank, world)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Worker for tests of save identity: runs of one job that reuse step numbers.

argv[1]: a JSON list of job specs, run one after the other, each a dict:
    job      job id
    resume   call ``ckpt.resume`` first and report what it loaded
    saves    [[step, salt], ...] saved in order with ``ckpt.save``; ``salt`` changes every value,
             so two saves of one step with different salts hold different bytes
    wait     after each save, ``wait_replicated(step)`` (reported)
    skip     steps saved back to back while this rank's replicator is held, so it finds them
             all at once and pushes only the newest; then ``wait_replicated`` of each

Reports "resume-<job>" {step, source, reason, salts: the salts whose state equals what was
loaded} and "saves-<job>" {replicated: [bool per save], seconds: [per wait]}.
"""

import json
import sys
import time

import torch.distributed as dist
from common import init, report
from states import differences, make_state, zeros_like_state

from mlcheckpoint import CheckpointManager
from mlcheckpoint.testing import internals

SALTS = range(4)
SKIP_TIMEOUT = 120


def state(rank: int, step: int, salt: int, world: int) -> dict:
    return make_state(step + 100_000 * salt, rank)


def run_job(spec: dict, rank: int, world: int) -> None:
    job = spec["job"]
    ckpt = CheckpointManager(job_id=job)
    if spec.get("resume"):
        sd = zeros_like_state(state(rank, 0, 0, world))
        info = ckpt.resume(sd)
        salts = [] if info.step is None else [s for s in SALTS if not differences(state(rank, info.step, s, world), sd)]
        report(f"resume-{job}", {"step": info.step, "source": info.source, "reason": info.reason,
                                 "salts": salts})
    replicated, seconds = [], []
    for step, salt in spec.get("saves", []):
        ckpt.save(state(rank, step, salt, world), step)
        if spec.get("wait"):
            t0 = time.monotonic()
            replicated.append(ckpt.wait_replicated(step, 60))
            seconds.append(time.monotonic() - t0)
    skip = spec.get("skip", [])
    if skip:
        with internals(ckpt).replicator._lock:  # the replicator thread waits here: it sees every step late
            for step in skip:
                ckpt.save(state(rank, step, 0, world), step)
        for step in skip:
            t0 = time.monotonic()
            replicated.append(ckpt.wait_replicated(step, SKIP_TIMEOUT))
            seconds.append(time.monotonic() - t0)
    report(f"saves-{job}", {"replicated": replicated, "seconds": seconds})
    ckpt.close()


def main() -> None:
    rank, world = init()
    for spec in json.loads(sys.argv[1]):
        run_job(spec, rank, world)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

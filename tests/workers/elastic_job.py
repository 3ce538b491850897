"""Worker for elastic-restart tests: jobs that resume into another shape (nodes x ranks).

argv[1]: a JSON list of job specs, run in order, each a dict:
    job      job id (its own tmpfs directory on every node)
    first, last   steps saved after the resume, each waited on until replicated (first > last:
             resume only)
    hold     after its saves, report and then sleep until the test kills the node (a node
             lost while the job runs); must be the last spec

The state is rec_jobs' "elastic" one (a DTensor sharded over all ranks plus replicated
tensors), valid for any world size. Reports per job: "resume-<job>" {step, source, resharded,
match, mismatch, world, reason} and "acked-<job>" {steps: the saved steps every partner
acknowledged}.
"""

import json
import sys
import time

import torch.distributed as dist
from common import diff, init, report
from rec_jobs import comparable, elastic_state, elastic_template
from torch.distributed.device_mesh import init_device_mesh

from mlcheckpoint import CheckpointManager


def run_job(spec: dict, rank: int, world: int, mesh) -> None:
    job = spec["job"]
    ckpt = CheckpointManager(job_id=job)
    sd = elastic_template(rank, world, mesh)
    info = ckpt.resume(sd)
    mismatch = ([] if info.step is None
                else diff(comparable(elastic_state(rank, world, info.step, mesh)), comparable(sd)))
    report(f"resume-{job}", {"step": info.step, "source": info.source, "resharded": info.resharded,
                             "match": not mismatch, "mismatch": mismatch, "world": world,
                             "reason": info.reason})
    acked = []
    for step in range(int(spec.get("first", 1)), int(spec.get("last", 0)) + 1):
        ckpt.save(elastic_state(rank, world, step, mesh), step)
        if ckpt.wait_replicated(step, 60):
            acked.append(step)
    ckpt.wait()
    report(f"acked-{job}", {"steps": acked})
    if spec.get("hold"):
        while True:  # the test SIGKILLs this node; the other node's ranks are killed after it
            time.sleep(1)
    ckpt.close()


def main() -> None:
    specs = json.loads(sys.argv[1])
    rank, world = init()
    mesh = init_device_mesh("cpu", (world,))
    for spec in specs:
        run_job(spec, rank, world, mesh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Worker for elastic-restart tests: jobs that resume into another shape (nodes x ranks).

argv[1]: a JSON list of job specs, run in order, each a dict:
    job      job id (its own tmpfs directory on every node)
    first, last   steps saved after the resume, each waited on until replicated (first > last:
             resume only)
    hold     after its saves, report and then sleep until the test kills the node (a node
             lost while the job runs); must be the last spec
    loop     a training loop under torchrun's elastic agent: after the resume, save the next
             steps (an all_reduce on the training group each step, so a lost node is noticed
             there) until the test kills a node; once restarted (TORCHELASTIC_RESTART_COUNT >
             0), save ``loop`` more steps and exit. Reports carry the restart count and the world
             size (a node joining restarts the workers without counting a restart):
             "resume-<job>-r<n>-w<world>", "acked-<job>-r<n>-w<world>" (rewritten after
             every step)
    ack_timeout  seconds to wait for each step's acknowledgement (default 60)
    domains  each node's failure domain (a list by node rank), given to the manager through
             MLCHECKPOINT_FAILURE_DOMAIN; absent: none named
    replicas partner nodes per node (the manager's ``replicas``); absent: its default
    layers   more sharded tensors in the state (each rank's piece of each: one more item in its
             shard); absent: none
    mib      one more tensor of about this many MiB sharded over all ranks (shards large enough
             for a test to measure what a node's tmpfs holds); absent: none

The state is rec_jobs' "elastic" one (a DTensor sharded over all ranks plus replicated
tensors), valid for any world size. Reports per job: "resume-<job>" {step, source, resharded,
match, mismatch, world, reason} and "acked-<job>" {steps: the saved steps every partner
acknowledged}.
"""

import os
import time

import torch
import torch.distributed as dist
from common import report, run_specs
from rec_jobs import ROWS, comparable, elastic_state, elastic_template
from states import differences
from torch.distributed.tensor import DTensor, Shard

from mlcheckpoint import CheckpointManager, ReplicationOptions


def with_layers(sd: dict, layers: int, rank: int, world: int, step: int, mesh) -> dict:
    """``sd`` and ``layers`` more tensors sharded over all ranks, of a size each (``step`` -1:
    zeros, a template to load into)."""
    for i in range(layers):
        full = torch.randn(ROWS, 8 * (i + 1), generator=torch.Generator().manual_seed(9000 + 97 * step + i))
        local = full.chunk(world)[rank].clone()
        sd[f"layer{i}"] = DTensor.from_local(local.zero_() if step < 0 else local, mesh, [Shard(0)],
                                             run_check=False, shape=full.shape, stride=full.stride())
    return sd


def with_bulk(sd: dict, mib: float, rank: int, world: int, step: int, mesh) -> dict:
    """``sd`` and a float32 tensor of about ``mib`` MiB sharded over all ranks (``step`` -1:
    zeros, a template to load into)."""
    if mib:
        rows = ROWS * 1024
        full = torch.randn(rows, max(1, int(mib * 2**20) // 4 // rows),
                           generator=torch.Generator().manual_seed(5000 + step))
        local = full.chunk(world)[rank].clone()
        sd["bulk"] = DTensor.from_local(local.zero_() if step < 0 else local, mesh, [Shard(0)],
                                        run_check=False, shape=full.shape, stride=full.stride())
    return sd


def run_job(spec: dict, rank: int, world: int, mesh) -> None:
    job = spec["job"]
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    job_names = f"{job}-r{restart}-w{world}" if spec.get("loop") else job  # this incarnation's reports
    if spec.get("domains"):
        os.environ["MLCHECKPOINT_FAILURE_DOMAIN"] = spec["domains"][int(os.environ["GROUP_RANK"])]
    else:
        os.environ.pop("MLCHECKPOINT_FAILURE_DOMAIN", None)
    ckpt = CheckpointManager(job_id=job, replication=ReplicationOptions(replicas=spec.get("replicas")))
    layers, mib = int(spec.get("layers", 0)), float(spec.get("mib", 0))

    def state(step: int) -> dict:
        sd = with_layers(elastic_state(rank, world, step, mesh), layers, rank, world, step, mesh)
        return with_bulk(sd, mib, rank, world, step, mesh)

    sd = with_bulk(with_layers(elastic_template(rank, world, mesh), layers, rank, world, -1, mesh),
                   mib, rank, world, -1, mesh)
    info = ckpt.resume(sd)
    mismatch = ([] if info.step is None
                else differences(comparable(state(info.step)), comparable(sd)))
    report(f"resume-{job_names}", {"step": info.step, "source": info.source,
                                   "resharded": info.resharded, "match": not mismatch,
                                   "mismatch": mismatch, "world": world, "reason": info.reason,
                                   "bytes_fetched": info.bytes_fetched,
                                   "served": {str(o): {str(n): b for n, b in by_node.items()}
                                              for o, by_node in info.bytes_served.items()}})
    acked: list[int] = []
    if spec.get("loop"):
        first = (info.step or 0) + 1
        last = first + int(spec["loop"]) - 1 if restart else 10**9
        for step in range(first, last + 1):
            dist.all_reduce(torch.ones(1))  # the training step's collective
            ckpt.save(state(step), step)
            if ckpt.wait_replicated(step, float(spec.get("ack_timeout", 60))):
                acked.append(step)
            report(f"acked-{job_names}", {"steps": acked})
    for step in range(int(spec.get("first", 1)), int(spec.get("last", 0)) + 1):
        ckpt.save(state(step), step)
        if ckpt.wait_replicated(step, 60):
            acked.append(step)
    ckpt.wait()
    report(f"acked-{job_names}", {"steps": acked})
    if spec.get("hold"):
        while True:  # the test SIGKILLs this node; the other node's ranks are killed after it
            time.sleep(1)
    ckpt.close()


def main() -> None:
    run_specs(run_job)


if __name__ == "__main__":
    main()

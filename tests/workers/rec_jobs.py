"""Worker for recovery tests: several independent jobs (job ids) in one launch, in order.

argv[1]: a JSON list of job specs, each a dict:
    job      job id (its own tmpfs directory on every node; persistent under
             $TEST_PERSISTENT_DIR/<job> when persist is set)
    first, last   steps saved after the resume (first > last: resume only)
    persist  save a persistent checkpoint every ``persist`` steps (0: no persistent dir)
    state    "rank": tests/workers/states.make_state(step, rank) (per-rank keys; one world size only)
             "elastic": only replicated tensors and a DTensor sharded over all ranks, valid
             for any world size (DCP reshards)
    crash    MLCHECKPOINT_CRASH_AT for this job only (the process dies there), or absent
    heal     after the resume, report whether the loaded step is protected again
    await_own    after the resume, wait (at most 60 s) until this rank's own shard of the
             loaded step is committed on this node (e.g. rebuilt after a replacement)
    back_to_back  save the next step at once; by default each saved step is first replicated
             (as in a job with compute between saves), so which steps the nodes hold does
             not depend on whether the replicator skipped a step for a newer one
    kill_after_read  this rank SIGKILLs itself as soon as its first transfer of shard bytes
             from a peer (Transport.read_items) has returned during the resume

Reports per job: "resume-<job>" {step, source, match, mismatch, reason, sources,
bytes_fetched, world, refused_copies}, "healed-<job>" {protected} and "listing-<job>" {entries}.
"""

import os

import torch
from common import report, run_specs
from states import differences, make_state, zeros_like_state
from torch.distributed.tensor import DTensor, Shard

from mlcheckpoint import CheckpointManager
from mlcheckpoint.testing import internals
from mlcheckpoint.testing.cluster import sigkill_self
from mlcheckpoint.waiting import deadline_in, wait_until

ROWS = 24  # divisible by every world size used (1, 2, 3, 4)


def elastic_state(rank: int, world: int, step: int, mesh) -> dict:
    g = torch.Generator().manual_seed(7000 + step)
    full = torch.randn(ROWS, 6, generator=g)
    local = full.chunk(world)[rank].clone()
    return {
        "dt": DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                 shape=full.shape, stride=full.stride()),
        "rep": torch.randn(40, generator=g).to(torch.bfloat16),  # replicated: saved once
        "count": torch.tensor([step, 3 * step], dtype=torch.int64),
        "extra": {"step": step, "tag": f"elastic-{step}"},
    }


def elastic_template(rank: int, world: int, mesh) -> dict:
    sd = elastic_state(rank, world, 0, mesh)
    return {"dt": DTensor.from_local(torch.zeros_like(sd["dt"].to_local()), mesh, [Shard(0)],
                                     run_check=False, shape=sd["dt"].shape,
                                     stride=sd["dt"].stride()),
            "rep": torch.zeros_like(sd["rep"]), "count": torch.zeros_like(sd["count"]),
            "extra": {"step": -1, "tag": ""}}


def comparable(sd: dict) -> dict:
    """DTensors as their local shard (what this rank must hold)."""
    return {k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in sd.items()}


def die_after_first_read(transport) -> None:
    """Fault injection: SIGKILL this process once shard bytes have arrived from a peer."""
    original = transport.read_items

    def wrapped(*args, **kwargs):
        result = original(*args, **kwargs)
        sigkill_self(f"rank {os.environ['RANK']}: its first peer read has returned")
        return result

    transport.read_items = wrapped


def run_job(spec: dict, rank: int, world: int, mesh) -> None:
    job = spec["job"]
    if spec.get("crash"):
        os.environ["MLCHECKPOINT_CRASH_AT"] = spec["crash"]
    else:
        os.environ.pop("MLCHECKPOINT_CRASH_AT", None)
    persist = int(spec.get("persist", 0))
    elastic = spec.get("state", "rank") == "elastic"
    persistent_dir = os.path.join(os.environ["TEST_PERSISTENT_DIR"], job) if persist else None
    ckpt = CheckpointManager(persistent_dir=persistent_dir, job_id=job)

    def state(step: int) -> dict:
        return elastic_state(rank, world, step, mesh) if elastic else make_state(step, rank)

    sd = elastic_template(rank, world, mesh) if elastic else zeros_like_state(make_state(0, rank))
    replicator = internals(ckpt).replicator
    if spec.get("kill_after_read") == rank and replicator is not None:
        die_after_first_read(replicator.transport)
    info = ckpt.resume(sd)
    mismatch = [] if info.step is None else differences(comparable(state(info.step)), comparable(sd))
    report(f"resume-{job}", {"step": info.step, "source": info.source, "match": not mismatch,
                             "mismatch": mismatch, "reason": info.reason,
                             "sources": info.sources, "bytes_fetched": info.bytes_fetched,
                             "world": world, "refused_copies": info.refused_copies})
    if spec.get("await_own") and info.step is not None:
        wait_until(lambda: rank in internals(ckpt).store.inventory.step_state(info.step).committed_ranks,
                   deadline_in(60), 0.05)
    if spec.get("heal") and info.step is not None and ckpt.replication_mode != "none":
        report(f"healed-{job}", {"step": info.step,
                                 "protected": ckpt.wait_replicated(info.step, 60)})
    for step in range(int(spec.get("first", 1)), int(spec.get("last", 0)) + 1):
        ckpt.save(state(step), step, persistent=bool(persist) and step % persist == 0)
        if ckpt.replication_mode != "none" and not spec.get("back_to_back"):
            ckpt.wait_replicated(step, 60)
    ckpt.wait()
    report(f"listing-{job}", {"entries": [e.__dict__ for e in ckpt.checkpoints()]})
    ckpt.close()


def main() -> None:
    run_specs(run_job)


if __name__ == "__main__":
    main()

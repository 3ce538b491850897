"""Worker: the tiers never fail together (tests/jobs/test_tiers.py, issue 42). One node, its
local_dir a small tmpfs the test mounts (or, for "vanish", the cluster's own).

argv: mode
  persist  each rank saves OWN MiB of its own with ``async_save`` every step up to LAST,
           persistent at steps PERSISTENT; another program holds FILLER MiB of the tmpfs
           until step FREE_AT, so every RAM save fails until then. Reports "persist": per
           step what the save said ("ok", or the error's type, message and notes), stats().
  resume   a fresh run (memory empty): reports "resume" {step, source, match}.
  dedup    a data-parallel job: REPLICATED MiB equal on every rank (DCP writes each tensor
           once), keep=1, steps 0-3: reports "dedup" per step what the save said.
  vanish   as persist without a filler, replication off; after step GONE_AFTER rank 0
           removes the job directory (as an outside cleanup would): reports "vanish".

The state of a step is a function of (step, rank), and the tensors are changed in place
after every call, as training would: a snapshot taken late shows.
"""

import os
import shutil
import sys

import torch
import torch.distributed as dist
from common import init, report

from mlcheckpoint import CheckpointManager

MiB = 1 << 20
OWN, FILLER = 4, 14
# dedup: per rank 7.25 MiB, of which DCP gives each 3.75 to write; a step is 7.5 MiB on the
# node, and a 20 MiB tmpfs holds the step kept and the one being saved only after dedup.
REPLICATED, OWN_DEDUP = 7, 0.25
LAST, PERSISTENT, FREE_AT, GONE_AFTER = 13, (5, 10), 12, 2


def state(step: int, rank: int, replicated: float = 0, own: float = OWN) -> dict:
    """``own`` MiB of the rank's own tensors, and ``replicated`` MiB in 4 tensors equal on
    every rank."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    sd = {f"own{rank}": {"a": torch.randn(int(own * MiB) // 8, generator=g),
                         "b": torch.randn(int(own * MiB) // 8, generator=g)},
          "step": step}
    shared = torch.Generator().manual_seed(step)
    for i in range(4 if replicated else 0):
        sd[f"w{i}"] = torch.randn(int(replicated * MiB) // 16, generator=shared)
    return sd


def change(sd: dict, into: dict) -> None:
    """``sd`` becomes ``into`` in place (its tensors written over, as an optimizer does)."""
    for key, value in into.items():
        if isinstance(value, dict):
            change(sd[key], value)
        elif isinstance(value, torch.Tensor):
            sd[key].copy_(value)
        else:
            sd[key] = value


def outcome(fut) -> str:
    error = fut.exception(timeout=120)
    if error is None:
        return "ok"
    return f"{type(error).__name__}: {error}"


def same(a: dict, b: dict) -> bool:
    return all(same(v, b[k]) if isinstance(v, dict) else
               torch.equal(v, b[k]) if isinstance(v, torch.Tensor) else v == b[k]
               for k, v in a.items())


def main() -> None:
    mode = sys.argv[1]
    rank, _ = init()
    local = os.environ["MLCHECKPOINT_LOCAL_DIR"]
    filler = os.path.join(local, "other-program")
    if mode == "persist" and rank == 0:
        with open(filler, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, FILLER * MiB)
    dist.barrier()
    persistent = os.environ["TEST_PERSISTENT_DIR"]
    if mode == "resume":
        ckpt = CheckpointManager(persistent, keep=2, replication="none")
        sd = state(0, rank)
        info = ckpt.resume(sd)
        report("resume", {"step": info.step, "source": info.source,
                          "match": info.step is not None and same(state(info.step, rank), sd)})
        ckpt.close()
        return
    dedup = mode == "dedup"
    ckpt = CheckpointManager(persistent, keep=1 if dedup else 2, replication="none")
    replicated, own = (REPLICATED, OWN_DEDUP) if dedup else (0, OWN)
    sd = state(0, rank, replicated, own)
    saves = []
    for step in range(4 if dedup else LAST + 1):
        if mode == "persist" and step == FREE_AT:
            dist.barrier()
            if rank == 0:
                os.unlink(filler)
            dist.barrier()
        change(sd, state(step, rank, replicated, own))
        fut = ckpt.async_save(sd, step, persistent=not dedup and step in PERSISTENT)
        change(sd, state(step + 100, rank, replicated, own))  # training goes on at once
        saves.append(outcome(fut))
        if mode == "vanish" and step == GONE_AFTER:
            dist.barrier()
            if rank == 0:
                shutil.rmtree(os.path.join(local, ckpt.job_id))
            dist.barrier()
    stats = ckpt.stats()
    ckpt.close()
    report(mode, {"saves": saves, "stats": stats})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

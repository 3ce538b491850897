"""Worker: the two ranks of one node save at once into a tmpfs that holds the shard of one of
them, not of both (tests/test_capacity_tmpfs.py mounts it as this node's local_dir).

argv: phase
  save:   step 1 fits. Step 2 (BIG MiB of its own per rank) is tried with save(), then with
          async_save(): each must fail with CapacityError on every rank, and the process lives.
  resume: the restarted job loads step 1 bit-exact, then saves step 3 (small) again.
"""

import sys

import torch
import torch.distributed as dist
from common import diff, empty_like, init, report

from mlcheckpoint import CapacityError, CheckpointManager

MiB = 1 << 20
SMALL, BIG = 1, 20


def state(rank: int, step: int, mib: int) -> dict:
    g = torch.Generator().manual_seed(100 * step + rank)
    return {f"rank{rank}": torch.randn(mib * MiB // 4, generator=g),
            "shared": torch.full((16,), float(step)), "step": step}


def outcome(attempt) -> str:
    try:
        attempt()
        return "ok"
    except CapacityError:
        return "CapacityError"
    except Exception as e:  # reported for the test's message
        return f"{type(e).__name__}: {e}"


def save_phase(ckpt: CheckpointManager, rank: int) -> None:
    ckpt.save(state(rank, 1, SMALL), 1)
    big = state(rank, 2, BIG)
    report("race", {
        "save": outcome(lambda: ckpt.save(big, 2)),
        "async_save": outcome(lambda: ckpt.async_save(big, 2).result(timeout=120)),
    })
    ckpt.wait()


def resume_phase(ckpt: CheckpointManager, rank: int) -> None:
    sd = empty_like(state(rank, 1, SMALL))
    info = ckpt.resume(sd)
    mismatch = diff(state(rank, 1, SMALL), sd)
    report("resumed", {"step": info.step, "source": info.source, "mismatch": mismatch,
                       "save3": outcome(lambda: ckpt.save(state(rank, 3, SMALL), 3)),
                       "complete": ckpt.store.complete_steps()})


def main() -> None:
    phase = sys.argv[1]
    rank, _world = init()
    ckpt = CheckpointManager(keep=1, replication="none")
    {"save": save_phase, "resume": resume_phase}[phase](ckpt, rank)
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

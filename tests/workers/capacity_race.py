"""Worker: the two ranks of one node save at once into a tmpfs that holds the shard of one of
them, not of both (tests/store/test_capacity_tmpfs.py mounts it as this node's local_dir).

argv: phase
  save:   step 1 fits. Step 2 (BIG MiB of its own per rank) is tried with save(), then with
          async_save(): each must fail with CapacityError on every rank, and the process lives.
          Step 1 then loads bit-exact, and step 3 (MID MiB per rank: fits only once the shard
          one rank did write of step 2 has been given back) is saved.
  resume: the restarted job resumes step 3 bit-exact.
"""

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from common import init, report
from states import differences, zeros_like_state

from mlcheckpoint import CapacityError, CheckpointManager
from mlcheckpoint.testing import internals

MiB = 1 << 20
SMALL, MID, BIG = 1, 7, 20


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
    except Exception as e:  # noqa: BLE001  (any other failure is the outcome the test reports)
        return f"{type(e).__name__}: {e}"


def save_phase(ckpt: CheckpointManager, rank: int) -> None:
    ckpt.save(state(rank, 1, SMALL), 1)
    big = state(rank, 2, BIG)
    save2 = outcome(lambda: ckpt.save(big, 2))
    async_save2 = outcome(lambda: ckpt.async_save(big, 2).result(timeout=120))
    ckpt.wait()
    complete = internals(ckpt).store.inventory.complete_steps()
    loaded = zeros_like_state(state(rank, 1, SMALL))
    dcp.load(loaded, storage_reader=ckpt.storage_reader(1), process_group=ckpt._save_pg)
    report("race", {"save": save2, "async_save": async_save2, "complete": complete,
                    "step1_mismatch": differences(state(rank, 1, SMALL), loaded),
                    "save3": outcome(lambda: ckpt.save(state(rank, 3, MID), 3))})


def resume_phase(ckpt: CheckpointManager, rank: int) -> None:
    sd = zeros_like_state(state(rank, 3, MID))
    info = ckpt.resume(sd)
    report("resumed", {"step": info.step, "source": info.source,
                       "mismatch": differences(state(rank, 3, MID), sd)})


def main() -> None:
    phase = sys.argv[1]
    rank, _world = init()
    ckpt = CheckpointManager(keep=1, replication="none")
    {"save": save_phase, "resume": resume_phase}[phase](ckpt, rank)
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

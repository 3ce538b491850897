"""Worker for tests/store/test_whole_step.py: save back to back for argv[1] seconds, argv[2] MiB of
its own per rank.

``async_save`` every step, never waiting for replication, so replication must skip steps. The
ranks agree each step on whether to go on (rank 0's clock), so all make the same saves.
Reports ``back_to_back``: saves made, replication rounds this rank finished, and
``ckpt.protection()`` once the last save committed.
"""

import sys
import time

import torch
import torch.distributed as dist
from common import init, report

from mlcheckpoint import CheckpointManager
from mlcheckpoint.testing import internals


def main() -> None:
    seconds, mib = float(sys.argv[1]), int(sys.argv[2])
    rank, _ = init()
    ckpt = CheckpointManager(keep=2)
    g = torch.Generator().manual_seed(rank)
    sd = {f"rank{rank}": {"w": torch.randn(mib << 18, generator=g)},
          "step": torch.zeros(1, dtype=torch.int64)}
    ckpt.resume(sd)
    end = time.monotonic() + seconds
    step = 0
    while True:
        go = [time.monotonic() < end]
        dist.broadcast_object_list(go, src=0)
        if not go[0]:
            break
        sd["step"].fill_(step)
        sd[f"rank{rank}"]["w"].add_(1)
        ckpt.async_save(sd, step)
        step += 1
    ckpt.wait()
    protection = ckpt.protection()
    ckpt.close()
    rep = internals(ckpt).replicator
    assert rep is not None
    report("back_to_back", {"saves": step, "rounds": rep.rounds.finished,
                            "protection": protection.__dict__})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

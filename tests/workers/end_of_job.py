"""Worker for tests/test_cli.py: save steps 0..argv[1]-1 back to back (so replication skips
some), wait until the last is protected, read ``ckpt.protection()``, close. Reports
``end_of_job``: that ``protection()`` and the last step."""

import sys

import torch
import torch.distributed as dist
from common import init, report

from mlcheckpoint import CheckpointManager


def main() -> None:
    steps = int(sys.argv[1])
    rank, _ = init()
    ckpt = CheckpointManager(keep=2)
    sd = {f"rank{rank}": torch.randn(1 << 18), "step": torch.zeros(1, dtype=torch.int64)}
    ckpt.resume(sd)
    for step in range(steps):
        sd["step"].fill_(step)
        ckpt.async_save(sd, step)
    ckpt.wait()
    replicated = ckpt.wait_replicated(steps - 1, timeout=60)
    protection = ckpt.protection()
    ckpt.close()
    report("end_of_job", {"last": steps - 1, "replicated": replicated,
                          "newest_protected": protection.newest_protected})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

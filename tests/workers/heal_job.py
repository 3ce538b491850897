"""Worker for tests/jobs/test_heal.py: save steps 1..last, or resume and wait for the heal.

argv: layout mode last [heal_timeout]; TEST_REPLICATION: the transport (default tcp)
  layout = rank (``make_state(step, rank)``: items DCP writes once, from rank 0, beside each
           rank's own) | ddp_rng (dp_copies.py's: an identical model beside per-rank entries)
  mode   = save: save steps 1..last (step 1 also to the persistent folder), wait until ``last``
           is protected, report "saved" {protected};
           resume: resume, report "resumed" {step, source, sources, reason, mismatch}; then,
           with ``heal_timeout`` > 0, ``wait_replicated(step, heal_timeout)`` and report
           "healed" {protected, seconds, newest_protected}. Saves nothing.
"""

import os
import sys
import time

import torch.distributed as dist
from common import init, report
from dp_copies import layout_state
from states import differences, make_state, zeros_like_state

from mlcheckpoint import CheckpointManager


def state(layout: str, step: int, rank: int) -> dict:
    if layout == "rank":
        return make_state(step, rank)
    return layout_state(layout, rank, int(os.environ["LOCAL_RANK"]), step)


def main() -> None:
    layout, mode, last = sys.argv[1], sys.argv[2], int(sys.argv[3])
    heal_timeout = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    rank, _ = init()
    ckpt = CheckpointManager(replication=os.environ.get("TEST_REPLICATION", "tcp"),
                             persistent_dir=os.environ["TEST_PERSISTENT_DIR"])
    if mode == "save":
        for step in range(1, last + 1):
            ckpt.save(state(layout, step, rank), step, persistent=step == 1)
        ckpt.wait()
        report("saved", {"protected": ckpt.wait_replicated(last, timeout=60)})
    else:
        sd = zeros_like_state(state(layout, 0, rank))
        info = ckpt.resume(sd)
        want = state(layout, info.step or 0, rank)
        report("resumed", {"step": info.step, "source": info.source, "sources": info.sources,
                           "reason": info.reason, "mismatch": differences(want, sd)})
        if heal_timeout > 0 and info.step is not None:
            t0 = time.monotonic()
            protected = ckpt.wait_replicated(info.step, timeout=heal_timeout)
            report("healed", {"protected": protected, "seconds": time.monotonic() - t0,
                              "newest_protected": ckpt.protection().newest_protected})
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

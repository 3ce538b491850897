"""Worker: a replicating job that a test probes and attacks from outside while it runs.

1. Save step 0 and wait until it is protected; report "ready" (this rank's secret, listener
   address and the job's MASTER_PORT: only the test may learn the secret, from this file).
2. Wait for ``$TEST_OUT_DIR/go`` (the test has started its attack on the replication port).
3. Save steps 1..last, waiting after each until it is protected (or ``timeout`` passes) and
   then ``pause`` seconds; report "attacked" with, per step, whether it was protected.
4. Wait for ``$TEST_OUT_DIR/stop`` (the test may still probe the job), then end.

argv: last timeout pause
"""

import os
import sys
import time

import torch.distributed as dist
from common import init, report
from states import make_state

from mlcheckpoint import CheckpointManager
from mlcheckpoint.testing import internals
from mlcheckpoint.waiting import deadline_in, wait_until


def wait_for_file(path: str, timeout: float = 300) -> None:
    if not wait_until(lambda: os.path.exists(path), deadline_in(timeout), 0.05):
        raise SystemExit(f"{path} never appeared")


def main() -> None:
    last, timeout, pause = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
    rank, _world = init()
    ckpt = CheckpointManager(replication="tcp")
    transport = internals(ckpt).replicator.transport
    ckpt.save(make_state(0, rank), 0)
    first_protected = ckpt.wait_replicated(0, 60)
    report("ready", {"secret": transport.secret.hex(), "address": transport.address,
                     "master_port": int(os.environ["MASTER_PORT"]), "protected": first_protected,
                     "prefix": internals(ckpt).replicator.rdzv.prefix})
    wait_for_file(os.path.join(os.environ["TEST_OUT_DIR"], "go"))
    protected = {}
    for step in range(1, last + 1):
        ckpt.save(make_state(step, rank), step)
        protected[step] = ckpt.wait_replicated(step, timeout)
        time.sleep(pause)
    report("attacked", {"protected": protected})
    wait_for_file(os.path.join(os.environ["TEST_OUT_DIR"], "stop"))
    dist.barrier()
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Worker: a save whose shard does not fit on one rank fails on every rank, alike, and the job
goes on (tests/jobs/test_failed_save.py mounts each node's local_dir as a small tmpfs).

argv: mode, one of
  guarded    ``guard(optimizer)`` and ``async_save`` every step (overlapped saves)
  unguarded  ``async_save`` every step, no guard
  blocking   ``save`` every step
  native     ``dcp.async_save(sd, storage_writer=ckpt.storage_writer(step),
             process_group=ckpt.process_group)`` every step

The job's last rank saves BIG MiB of its own, every other rank SMALL MiB, and every rank a
share of one DTensor (as FSDP would). Before the job, FILLER MiB of the last node's tmpfs are
taken by another program (a file beside the job's folder). With keep=2, steps 0 and 1 fit;
from step 2 on, the last rank's third buffer does not. Before step FREE_AT, the other
program's file goes: the saves fit again. Each rank reports ("saves"): per step what its save
said ("ok", the error's type and message, or "timeout" when it said nothing for STEP_TIMEOUT
seconds), the node's complete steps while its tmpfs was full, whether step 1 then loaded bit
for bit (one node only: another node's shards are a resume's to fetch), and how long
``close()`` took.
"""

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from common import init, report
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from mlcheckpoint import CheckpointManager
from mlcheckpoint.testing import internals

MiB = 1 << 20
BIG, SMALL, FILLER = 16, 1, 16
STEPS, FREE_AT = 7, 5  # steps 2, 3 and 4 do not fit
STEP_TIMEOUT = 60


def outcome(error: BaseException | None) -> str:
    if error is None:
        return "ok"
    if isinstance(error, CheckpointException):  # DCP's own, for a DCP-native save
        failures = {rank: f[0] if isinstance(f, tuple) else f for rank, f in error.failures.items()}
        return "CheckpointException: " + "; ".join(
            f"rank {rank}: {outcome(failures[rank])}" for rank in sorted(failures))
    return f"{type(error).__name__}: {error}"


def save(ckpt: CheckpointManager, mode: str, sd: dict, step: int) -> str:
    """What the save of ``step`` said on this rank, once it is over."""
    try:
        if mode == "blocking":
            ckpt.save(sd, step)
            return "ok"
        if mode == "native":
            fut = dcp.async_save(sd, storage_writer=ckpt.storage_writer(step),
                                 process_group=ckpt.process_group)
        else:
            fut = ckpt.async_save(sd, step)
    except Exception as e:  # noqa: BLE001  (the outcome is what the test compares)
        return outcome(e)
    try:
        return outcome(fut.exception(timeout=STEP_TIMEOUT))
    except TimeoutError:
        return "timeout"


def take_room(path: str) -> None:
    """Another program's file of FILLER MiB (its pages allocated)."""
    with open(path, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, FILLER * MiB)


def main() -> None:
    mode = sys.argv[1]
    rank, world = init()
    nodes = world // int(os.environ["LOCAL_WORLD_SIZE"])
    filler = os.path.join(os.environ["MLCHECKPOINT_LOCAL_DIR"], "other-program")
    owns_filler = int(os.environ["GROUP_RANK"]) == nodes - 1 and int(os.environ["LOCAL_RANK"]) == 0
    if owns_filler:
        take_room(filler)
    dist.barrier()
    mesh = init_device_mesh("cpu", (world,))
    weight = torch.zeros((BIG if rank == world - 1 else SMALL) * MiB // 4, requires_grad=True)
    shared = distribute_tensor(torch.zeros(world * 1024), mesh, [Shard(0)])
    optimizer = torch.optim.SGD([weight], lr=1.0)
    sd = {f"weight{rank}": weight, "shared": shared, "step": 0}
    ckpt = CheckpointManager(keep=2)
    if mode == "guarded":
        ckpt.guard(optimizer)
    saves, complete, step1_loaded, step1 = [], None, None, None
    for step in range(STEPS):
        if step == FREE_AT:  # the tmpfs is still full
            complete = internals(ckpt).store.inventory.complete_steps()
            if nodes == 1:
                loaded = {f"weight{rank}": torch.zeros_like(weight), "step": -1,
                          "shared": distribute_tensor(torch.zeros(world * 1024), mesh, [Shard(0)])}
                dcp.load(loaded, storage_reader=ckpt.storage_reader(1), process_group=ckpt.process_group)
                step1_loaded = (torch.equal(loaded[f"weight{rank}"], step1[0])
                                and torch.equal(loaded["shared"].to_local(), step1[1])
                                and loaded["step"] == 1)
            if owns_filler:
                os.unlink(filler)
            dist.barrier()
        weight.grad = torch.full_like(weight, -1.0)
        optimizer.step()  # a guard waits here for the snapshot in flight
        with torch.no_grad():
            shared.add_(1.0)
        sd["step"] = step
        if step == 1:
            step1 = (weight.detach().clone(), shared.to_local().clone())
        saves.append(save(ckpt, mode, sd, step))
        if nodes > 1 and saves[-1] == "ok":
            # A step replicated before the next save lets retention retire the step before
            # it (it keeps the newest step replicated everywhere): the room each save finds
            # then does not depend on how fast this machine's loopback replicates.
            ckpt.wait_replicated(step, STEP_TIMEOUT)
    t0 = time.monotonic()
    ckpt.close()
    report("saves", {"saves": saves, "complete": complete, "step1_loaded": step1_loaded,
                     "close_s": time.monotonic() - t0})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

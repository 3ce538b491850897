"""Worker: save steps [0, last] of a data-parallel layout with replication; report what
replication sent and what the job calls protected. With ``resume``: resume first and report
whether the loaded state is bit-exact, then save nothing.

argv: layout last mode [resume] ; layout = ddp | differ | fsdp | hsdp ; mode = sync | async | dcp
Environment: TEST_MEMORY_LIMIT (bytes) and TEST_KEEP, passed to the manager when set.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from common import init, report
from states import differences, zeros_like_state

from mlcheckpoint import CheckpointManager


def layout_state(layout: str, rank: int, local_rank: int, step: int) -> dict:
    """A deterministic state dict. ddp: every rank alike; differ: ddp, but rank 1's
    ``model.w`` differs (a replica that is not bit-identical); fsdp: every rank its own
    keys; hsdp: local rank k of every node holds shard k (sharded within the node,
    replicated across nodes)."""
    g = torch.Generator().manual_seed(1000 * step)
    if layout in ("ddp", "differ"):
        # four tensors of 128 KiB (DCP gives two to each of two ranks) and small items
        sd = {"model": {"w": torch.randn(128, 256, generator=g), "b": torch.randn(128, generator=g),
                        "emb": torch.randn(128, 256, generator=g)},
              "optim": {"m": torch.randn(128, 256, generator=g),
                        "v": torch.randn(128, 256, generator=g), "step": step, "lr": [0.1]}}
        if layout == "differ" and rank == 1:
            sd["model"]["w"][0, 0] += 1.0
        return sd
    if layout == "fsdp":
        r = torch.Generator().manual_seed(1000 * step + rank + 1)
        return {f"rank{rank}": {"w": torch.randn(128, 64, generator=r)}}
    s = torch.Generator().manual_seed(1000 * step + local_rank + 1)
    return {f"shard{local_rank}": {"w": torch.randn(128, 64, generator=s),
                                   "m": torch.randn(64, 64, generator=s)}}


def main() -> None:
    layout, last, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    resume = len(sys.argv) > 4 and sys.argv[4] == "resume"
    rank, _ = init()
    local_rank = int(os.environ["LOCAL_RANK"])
    kwargs = {}
    if "TEST_MEMORY_LIMIT" in os.environ:
        kwargs["memory_limit_bytes"] = int(os.environ["TEST_MEMORY_LIMIT"])
    if "TEST_KEEP" in os.environ:
        kwargs["keep"] = int(os.environ["TEST_KEEP"])
    ckpt = CheckpointManager(replication="tcp", **kwargs)
    if resume:
        sd = zeros_like_state(layout_state(layout, rank, local_rank, 0))
        info = ckpt.resume(sd)
        want = layout_state(layout, rank, local_rank, info.step or 0)
        report("resumed", {"step": info.step, "source": info.source, "reason": info.reason,
                           "sources": info.sources, "bytes_served": info.bytes_served,
                           "mismatch": differences(want, sd), "bytes_fetched": info.bytes_fetched})
        ckpt.close()
        dist.destroy_process_group()
        return
    for step in range(last + 1):
        sd = layout_state(layout, rank, local_rank, step)
        if mode == "sync":
            ckpt.save(sd, step)
        elif mode == "async":
            ckpt.async_save(sd, step)
        else:
            dcp.save(sd, storage_writer=ckpt.storage_writer(step))
    ckpt.wait()
    protected = ckpt.wait_replicated(last, timeout=60)
    state = ckpt.replication_state(last)
    report("copies", {"protected": protected, "newest_protected": ckpt.protection().newest_protected,
                      "state": None if state is None else state.state,
                      "reason": None if state is None else state.reason,
                      "sent": None if state is None else state.bytes,
                      "stats": ckpt.stats()})
    dist.barrier()
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Worker: save steps [0, last] of a data-parallel layout with replication; report what
replication sent and what the job calls protected. With ``resume``: resume first and report
whether the loaded state is bit-exact, then save nothing.

argv: layout last mode [resume]
  layout = ddp | differ | fsdp | hsdp | ddp_rng | mixed
  mode = sync | async | dcp | process (dcp.async_save in DCP's PROCESS mode)
Environment: TEST_MEMORY_LIMIT (bytes), TEST_KEEP and TEST_SCALE (the ddp layouts' tensors
are this many times larger), passed on when set.
Or argv: a JSON list of job specs ({"job", "layout", "last", "mode", "resume",
"memory_limit_bytes", "keep"}), run one after the other in this launch, each as its own job.
"""

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from common import init, report, run_specs
from states import differences, zeros_like_state
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from mlcheckpoint import CheckpointManager

RNG_BYTES = 5056  # what torch.get_rng_state() holds


def layout_state(layout: str, rank: int, local_rank: int, step: int) -> dict:
    """A deterministic state dict. ddp: every rank alike; differ: ddp, but rank 1's
    ``model.w`` differs (a replica that is not bit-identical); ddp_rng: ddp with each rank's
    own entries, as real jobs keep (an RNG state of ``RNG_BYTES`` and a data loader's
    position, under keys of their rank); fsdp: every rank its own keys; mixed: FSDP with
    replicated parameters (``model.emb``, ``model.b`` alike everywhere) beside each rank's own
    shard (``rank<r>.w``, the one item no other node holds); hsdp: local rank k of every node
    holds shard k (sharded within the node, replicated across nodes)."""
    g = torch.Generator().manual_seed(1000 * step)
    if layout in ("ddp", "differ", "ddp_rng"):
        # four tensors of 128 KiB (DCP gives two to each of two ranks) and small items
        n = 128 * int(os.environ.get("TEST_SCALE", "1"))
        sd = {"model": {"w": torch.randn(n, 256, generator=g), "b": torch.randn(128, generator=g),
                        "emb": torch.randn(n, 256, generator=g)},
              "optim": {"m": torch.randn(n, 256, generator=g),
                        "v": torch.randn(n, 256, generator=g), "step": step, "lr": [0.1]}}
        if layout == "differ" and rank == 1:
            sd["model"]["w"][0, 0] += 1.0
        if layout == "ddp_rng":
            r = torch.Generator().manual_seed(1000 * step + rank + 7)
            sd[f"rng.rank{rank}"] = torch.randint(0, 256, (RNG_BYTES,), dtype=torch.uint8, generator=r)
            sd[f"loader.rank{rank}"] = {"epoch": step // 10, "position": 1000 * step + rank}
        return sd
    if layout == "mixed":
        r = torch.Generator().manual_seed(1000 * step + rank + 1)
        return {"model": {"emb": torch.randn(256, 128, generator=g), "b": torch.randn(64, generator=g)},
                f"rank{rank}": {"w": torch.randn(96, 64, generator=r)}}
    if layout == "fsdp":
        r = torch.Generator().manual_seed(1000 * step + rank + 1)
        return {f"rank{rank}": {"w": torch.randn(128, 64, generator=r)}}
    s = torch.Generator().manual_seed(1000 * step + local_rank + 1)
    return {f"shard{local_rank}": {"w": torch.randn(128, 64, generator=s),
                                   "m": torch.randn(64, 64, generator=s)}}


def run_job(spec: dict, rank: int, _world: int = 0, _mesh: object = None) -> None:
    """Save steps [0, spec["last"]] of ``spec["layout"]`` (or, with ``spec["resume"]``, resume
    them) as the job ``spec["job"]`` (None: the environment's), reporting under names that end
    in ``-<job>`` when it has one."""
    layout, last, mode = spec["layout"], spec["last"], spec.get("mode", "sync")
    job = spec.get("job")
    suffix = f"-{job}" if job else ""
    local_rank = int(os.environ["LOCAL_RANK"])
    kwargs = {key: spec[key] for key in ("memory_limit_bytes", "keep") if key in spec}
    ckpt = CheckpointManager(replication="tcp", job_id=job, **kwargs)
    if spec.get("resume"):
        sd = zeros_like_state(layout_state(layout, rank, local_rank, 0))
        info = ckpt.resume(sd)
        want = layout_state(layout, rank, local_rank, info.step or 0)
        report(f"resumed{suffix}", {"step": info.step, "source": info.source, "reason": info.reason,
                                    "sources": info.sources, "bytes_served": info.bytes_served,
                                    "mismatch": differences(want, sd), "bytes_fetched": info.bytes_fetched})
        t0 = time.monotonic()
        ckpt.close()
        report(f"closed{suffix}", {"close_s": time.monotonic() - t0})
        return
    for step in range(last + 1):
        sd = layout_state(layout, rank, local_rank, step)
        if mode == "sync":
            ckpt.save(sd, step)
        elif mode == "async":
            ckpt.async_save(sd, step)
        elif mode == "process":
            dcp.async_save(sd, storage_writer=ckpt.storage_writer(step),
                           async_checkpointer_type=AsyncCheckpointerType.PROCESS).result()
        else:
            dcp.save(sd, storage_writer=ckpt.storage_writer(step))
    ckpt.wait()
    protected = ckpt.wait_replicated(last, timeout=60)
    state = ckpt.replication_state(last)
    report(f"copies{suffix}", {"protected": protected, "newest_protected": ckpt.protection().newest_protected,
                               "state": None if state is None else state.state,
                               "reason": None if state is None else state.reason,
                               "sent": None if state is None else state.bytes,
                               "stats": ckpt.stats()})
    dist.barrier()
    ckpt.close()


def main() -> None:
    if sys.argv[1].startswith("["):  # several jobs, one after the other, in this launch
        run_specs(run_job)
        return
    spec: dict = {"layout": sys.argv[1], "last": int(sys.argv[2]), "mode": sys.argv[3],
                  "resume": len(sys.argv) > 4 and sys.argv[4] == "resume"}
    if "TEST_MEMORY_LIMIT" in os.environ:
        spec["memory_limit_bytes"] = int(os.environ["TEST_MEMORY_LIMIT"])
    if "TEST_KEEP" in os.environ:
        spec["keep"] = int(os.environ["TEST_KEEP"])
    rank, _ = init()
    run_job(spec, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

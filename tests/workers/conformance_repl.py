"""Worker: shards with no tensor bytes, replicated over TCP and recovered (2 nodes x 1 rank).

argv: save | resume
  save:   step 1 holds one replicated tensor (DCP leaves one rank with no item at all), step 2
          adds a per-rank string (the rank without the tensor holds only that byte item).
          Waits until each step is protected; reports what each node holds ("repl_save").
  resume: resumes (node 1 was wiped: rank 1's step-2 shard must come from node 0); reports
          what it loaded and whether the step is protected again ("repl_resume").
"""

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from common import init, report
from states import differences

from mlcheckpoint import CheckpointManager
from mlcheckpoint.testing import internals


def rep(step: int) -> torch.Tensor:
    return torch.randn(64, generator=torch.Generator().manual_seed(step))


def step_state(step: int, rank: int) -> dict:
    sd = {"rep": rep(step)}
    if step == 2:
        sd[f"note{rank}"] = f"from rank {rank}"
    return sd


def holdings(ckpt: CheckpointManager) -> dict:
    """{step: {owner: [items, data_bytes]}} of every verified shard on this node."""
    out = {}
    for step, st in internals(ckpt).store.inventory.all().items():
        out[step] = {}
        for owner in sorted(st.committed_ranks):
            m = internals(ckpt).store.verify_shard(step, owner)
            out[step][owner] = [len(m.items), m.data_bytes]
    return out


def main() -> None:
    phase = sys.argv[1]
    rank, _ = init()
    ckpt = CheckpointManager(replication="tcp", keep=2)
    # No data-parallel copies (dcp/copies.py): with them rank 1 would keep a copy of "rep"
    # and hold bytes, and no shard would need sending; here the shards must travel.
    internals(ckpt).saver.copy_policy = None
    if phase == "save":
        dcp.save(step_state(1, rank), storage_writer=ckpt.storage_writer(1))
        # Step 1 replicated before step 2 is saved: on a loaded machine the replicator would
        # otherwise find both at once and skip step 1 for the newer (a superseded step is
        # never sent), and its shard with no item would not travel.
        ckpt.wait_replicated(1, timeout=60)
        ckpt.save(step_state(2, rank), 2)
        protected = ckpt.wait_replicated(2, timeout=60)
        dist.barrier()  # both nodes' replicas are in before either lists its holdings
        report("repl_save", {"protected": protected, "held": holdings(ckpt)})
    else:
        target = {"rep": torch.zeros(64), f"note{rank}": None}
        info = ckpt.resume(target)
        healed = ckpt.wait_replicated(info.step, timeout=60) if info.step is not None else False
        report("repl_resume", {"step": info.step, "sources": info.sources, "reason": info.reason,
                               "mismatch": differences(step_state(2, rank), target), "healed": healed})
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Worker: save steps [0, last] with replication, wait until protected, report what this node holds.

argv: last mode transport ; mode = async | sync | dcp | dcp_async_process
"""

import sys

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from common import init, report
from states import make_state

from mlcheckpoint import CheckpointManager
from mlcheckpoint.store import LocalStore
from mlcheckpoint.testing import internals


def main() -> None:
    last, mode, transport = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    rank, _world = init()
    ckpt = CheckpointManager(replication=transport)
    for step in range(last + 1):
        sd = make_state(step, rank)
        if mode == "async":
            ckpt.async_save(sd, step)
        elif mode == "sync":
            ckpt.save(sd, step)
        elif mode == "dcp":
            dcp.save(sd, storage_writer=ckpt.storage_writer(step))
        elif mode == "dcp_async_process":
            from torch.distributed.checkpoint.state_dict_saver import (
                AsyncCheckpointerType,
            )
            dcp.async_save(sd, storage_writer=ckpt.storage_writer(step),
                           async_checkpointer_type=AsyncCheckpointerType.PROCESS).result()
    ckpt.wait()
    protected = ckpt.wait_replicated(last, timeout=60)
    dist.barrier()
    store = LocalStore()
    held = {}
    for step, st in store.inventory.all().items():
        verified = []
        for r in sorted(st.committed_ranks):
            store.verify_shard(step, r)
            verified.append(r)
        held[step] = {"ranks": verified, "metadata": st.has_metadata}
    listing = [e.__dict__ for e in ckpt.checkpoints()]
    replicator = internals(ckpt).replicator
    server = getattr(replicator.transport, "server", None) if replicator else None
    report("replicate", {"protected": protected, "held": held, "listing": listing,
                         "targets": replicator.targets if replicator else [],
                         "sources": replicator.sources if replicator else [],
                         # this rank's TCP listener: striped receives, by stream count
                         "striped": server.stripes.landed() if server is not None else {}})
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

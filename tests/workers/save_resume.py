"""Worker: resume (reporting what was found), then save steps [first, last].

argv: first last mode [persistent_every [transport]] ; mode = sync | async | dcp | dcp_async
"""

import os
import sys

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from common import init, report
from states import differences, make_state, zeros_like_state

from mlcheckpoint import CheckpointManager


def main() -> None:
    first, last, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    persist_every = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    transport = sys.argv[5] if len(sys.argv) > 5 else "tcp"

    rank, _world = init()
    ckpt = CheckpointManager(persistent_dir=os.environ["TEST_PERSISTENT_DIR"] if persist_every else None,
                             replication=transport)
    sd = zeros_like_state(make_state(0, rank))
    info = ckpt.resume(sd)
    mismatch = [] if info.step is None else differences(make_state(info.step, rank), sd)
    report("resume", {"step": info.step, "source": info.source, "match": not mismatch,
                      "mismatch": mismatch, "reason": info.reason, "sources": info.sources,
                      "bytes_fetched": info.bytes_fetched})
    if info.step is not None and ckpt.replication_mode != "none":
        # self-healing: the loaded step is re-protected without waiting for the next save
        report("healed", {"step": info.step, "protected": ckpt.wait_replicated(info.step, 60)})

    for step in range(first, last + 1):
        sd = make_state(step, rank)
        persistent = bool(persist_every) and step % persist_every == 0
        if mode == "sync":
            ckpt.save(sd, step, persistent=persistent)
        elif mode == "async":
            ckpt.async_save(sd, step, persistent=persistent)
        elif mode == "dcp":
            dcp.save(sd, storage_writer=ckpt.storage_writer(step), process_group=ckpt.process_group)
        elif mode == "dcp_async":
            dcp.async_save(sd, storage_writer=ckpt.storage_writer(step),
                           process_group=ckpt.process_group).result()
        elif mode == "dcp_async_process":
            from torch.distributed.checkpoint.state_dict_saver import (
                AsyncCheckpointerType,
            )
            dcp.async_save(sd, storage_writer=ckpt.storage_writer(step),
                           process_group=ckpt.process_group,
                           async_checkpointer_type=AsyncCheckpointerType.PROCESS).result()
        # Mutate the live state right after the call: a correct async save already has its copy.
        for t in sd["model"].values():
            t.add_(1)
    ckpt.wait()
    if last >= first and ckpt.replication_mode != "none":
        report("protected", {"step": last, "protected": ckpt.wait_replicated(last, 60)})
    report("listing", {"entries": [e.__dict__ for e in ckpt.checkpoints()]})
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

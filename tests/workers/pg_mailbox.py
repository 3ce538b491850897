"""Worker: a process-group transport (world of one, gloo) whose store mailbox a test writes to,
as an authenticated peer and as a stranger. No torchrun: it joins the test's TCPStore.

argv: one JSON object
    host, port     the test's TCPStore (also the process group's store)
    job, dir       job id and this node's local dir (a 4 KiB shard of step 5, rank 0, is
                   committed there first, so requests for it have something to read)
    status_dir     where ``ready`` goes: the run's session and key prefix

The replication secret comes from MLCHECKPOINT_REPLICATION_SECRET (the test sets it). The
worker serves until its stdin closes.
"""

from __future__ import annotations

import json
import logging
import sys

from repl_peer import make_shard, write_status

logging.basicConfig(level=logging.INFO, format="%(asctime)s r%(process)d %(name)s %(levelname)s %(message)s")


def main() -> None:
    cfg = json.loads(sys.argv[1])
    import torch.distributed as dist

    from mlcheckpoint.replication import Rendezvous
    from mlcheckpoint.replication.pg.transport import PgTransport
    from mlcheckpoint.settings import ReplicationOptions
    from mlcheckpoint.store import LocalStore

    c10d = dist.TCPStore(cfg["host"], cfg["port"], is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore("pg_mailbox", c10d), rank=0, world_size=1)
    store = LocalStore(cfg["dir"], cfg["job"])
    make_shard(store, 5, 0, 4096)
    rdzv = Rendezvous.from_default_group(cfg["job"], timeout=60)
    transport = PgTransport(store, rdzv, ReplicationOptions(mode="pg", timeout=30))
    write_status(cfg["status_dir"], "ready", {"session": rdzv.session.hex(), "prefix": rdzv.prefix})
    sys.stdin.read()  # the test closes our stdin to end us
    transport.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

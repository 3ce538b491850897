"""Worker: one rank of a process-group transport job of several nodes (gloo), whose store
operations are counted. No torchrun: it joins the test's TCPStore.

argv: one JSON object
    host, port     the test's TCPStore (also the process group's store)
    job, dir       job id and this rank's node's local dir (shared by the node's ranks); a
                   4 KiB shard of step 5 of this rank (bytes seeded by the rank) is committed
                   there first
    rank, world, per_node, secret (hex), status_dir

Then it reads commands from stdin, one JSON object a line, and answers each in
``status_dir/<what>-<rank>-<id>``:
    {"cmd": "count", "id": n}            the store operations this rank's transport made so far
    {"cmd": "read", "peer": p, "id": n}  read_items of rank p's shard of step 5 from rank p:
                                         the sha256 of the bytes
It ends when its stdin closes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys

import numpy as np
from repl_peer import make_shard, write_status

logging.basicConfig(level=logging.INFO, format="%(asctime)s r%(process)d %(name)s %(levelname)s %(message)s")
NBYTES = 4096


class Counted:
    """A c10d client (each thread's, under the rendezvous' prefix) that counts each call the
    library makes on it. It wraps the PrefixStore from above: c10d does not pass
    ``delete_key`` down to a store written in Python (``testing.control.CountingStore``)."""

    def __init__(self, inner, counts):
        self._inner, self._counts = inner, counts

    def __getattr__(self, name: str):
        op = getattr(self._inner, name)

        def counted(*args, **kwargs):
            self._counts.count(name)
            return op(*args, **kwargs)
        return counted


def main() -> None:
    cfg = json.loads(sys.argv[1])
    import torch.distributed as dist

    from mlcheckpoint.replication import Rendezvous
    from mlcheckpoint.replication.pg.transport import PgTransport
    from mlcheckpoint.settings import ReplicationOptions
    from mlcheckpoint.store import LocalStore
    from mlcheckpoint.testing.control import OpCounts
    from mlcheckpoint.topology import Topology

    class CountingRendezvous(Rendezvous):
        @property
        def store(self):
            local = self._local  # one client per thread, as the library's
            if getattr(local, "counted", None) is None:
                local.counted = Counted(super().store, counts)
            return local.counted

    rank, status = cfg["rank"], cfg["status_dir"]
    c10d = dist.TCPStore(cfg["host"], cfg["port"], is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore("pg_node", c10d), rank=rank,
                            world_size=cfg["world"])
    store = LocalStore(cfg["dir"], cfg["job"])
    make_shard(store, 5, rank, NBYTES, seed=rank)
    counts = OpCounts()
    rdzv = CountingRendezvous(c10d, cfg["job"], rank, cfg["world"], timeout=60,
                              secret=bytes.fromhex(cfg["secret"]), session=b"this run")
    per_node = cfg["per_node"]
    topology = Topology(rank=rank, world_size=cfg["world"], local_rank=rank % per_node,
                        local_world_size=per_node, node_rank=rank // per_node,
                        num_nodes=cfg["world"] // per_node)
    transport = PgTransport(store, rdzv, ReplicationOptions(mode="pg", timeout=30),
                            topology=topology)
    write_status(status, f"ready-{rank}", {})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "count":
            write_status(status, f"count-{rank}-{cmd['id']}", {"ops": counts.total()})
        elif cmd["cmd"] == "read":
            sink = np.zeros(NBYTES, dtype=np.uint8)
            transport.read_items(cmd["peer"], 5, cmd["peer"], [(0, NBYTES)], [sink])
            write_status(status, f"read-{rank}-{cmd['id']}",
                         {"sha256": hashlib.sha256(sink.tobytes()).hexdigest()})
    assert transport.close(), "the transport's threads did not end"
    store.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

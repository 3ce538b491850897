"""Worker: rank 1 of a two-rank job, serving transports (tests/replication/test_transport_contract.py).

No torchrun: it joins the test's TCPStore and a gloo default group of two (the test process is
rank 0), builds one transport of each kind with ``make_transport`` as the manager does (all
landing in one sink), and serves until its stdin closes. A test can SIGSTOP it for real.

argv: one JSON object
    host, port       the test's TCPStore
    job, dir         job id and this node's local dir
    kinds, timeout   the transports (``make_transport``'s kinds, built in this order, as on
                     rank 0) and their timeout (seconds)
    bandwidth        this node's replication budget (bytes/s; default 0: no cap)
    device           CUDA device to select first (for "nccl")
    status_dir       where ``received-<step>-<owner>`` goes for every replica a peer pushed
                     here (the sink's ReplicaReceived event)
"""

from __future__ import annotations

import json
import logging
import sys

from repl_peer import write_status

logging.basicConfig(level=logging.INFO, format="%(asctime)s r%(process)d %(name)s %(levelname)s %(message)s")


def main() -> None:
    cfg = json.loads(sys.argv[1])
    import torch
    import torch.distributed as dist

    from mlcheckpoint.replication import ReceiveSink, Rendezvous, ReplicaReceived
    from mlcheckpoint.replication.factory import make_transport
    from mlcheckpoint.settings import ReplicationOptions
    from mlcheckpoint.store import LocalStore

    if cfg.get("device") is not None:
        torch.cuda.set_device(cfg["device"])
    c10d = dist.TCPStore(cfg["host"], cfg["port"], is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore("contract", c10d), rank=1, world_size=2)
    store = LocalStore(cfg["dir"], cfg["job"])
    rdzv = Rendezvous.from_default_group(cfg["job"], timeout=60)

    def on_received(event: ReplicaReceived) -> None:
        write_status(cfg["status_dir"], f"received-{event.step}-{event.owner}", {})

    sink = ReceiveSink(store, subscribers=[on_received])
    transports = [make_transport(store, rdzv, sink, ReplicationOptions(
        mode=kind, host="127.0.0.1", timeout=cfg["timeout"], bandwidth=cfg.get("bandwidth", 0)))
        for kind in cfg["kinds"]]
    dist.barrier()  # every transport exists on both ranks: the test may start
    sys.stdin.read()  # the test closes our stdin to end us
    for t in transports:
        t.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

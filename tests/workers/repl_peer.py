"""Worker: one replication endpoint (a simulated node's rank) in a process of its own, so a test
can SIGKILL or SIGSTOP it for real. No torchrun: it joins the test's TCPStore directly.

argv: one JSON object
    host, port       the test's TCPStore
    job, rank, world the job as the Rendezvous sees it
    dir              this node's MLCHECKPOINT_LOCAL_DIR
    status_dir       where ``<rank>.ready`` (our listener address) and ``<rank>.result`` go
    timeout          TcpTransport socket timeout (seconds)
    streams, min_stripe_bytes   how pushes are striped (default: one stream)
    bandwidth        the node's replication budget, bytes/s (default 0: no cap)
    cmd              "serve": listen until stdin closes (or we are killed)
                     "push": commit a shard (step, owner=rank, nbytes, seed) here, then push it
                             to rank ``peer`` and report {"ok", "bytes" | "error", "bytes_sent"
                             (what went through the budget in this process)}
                     "replicate": rank ``rank`` of ``nodes`` x ``per_node`` ranks with a replicator:
                             for each step read from stdin, commit a shard (nbytes, seed 0),
                             tell the replicator and write ``<rank>.saved-<step>``; until
                             stdin closes

``make_shard`` is also imported by the tests, so both sides build byte-identical shards.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import sys

import numpy as np

from mlcheckpoint.integrity import digests
from mlcheckpoint.integrity.verify import digest_item
from mlcheckpoint.store import LocalStore, Manifest, ManifestItem

logging.basicConfig(level=logging.INFO, format="%(asctime)s r%(process)d %(name)s %(levelname)s %(message)s")


def make_shard(store: LocalStore, step: int, owner: int, nbytes: int, seed: int = 0,
               nitems: int = 4, run_id: str = "", algorithms: tuple[str, ...] = (digests.XXH3,)
               ) -> Manifest:
    """Commit a shard of ``nbytes`` deterministic bytes (a function of seed) in ``nitems`` items,
    as a save of run ``run_id``; item k's checksum under ``algorithms[k % len(algorithms)]``
    (wsum64: as a save from device memory records it)."""
    shard = store.begin_shard(step, owner, nbytes)
    data = np.frombuffer(np.random.default_rng(seed).bytes(nbytes), dtype=np.uint8)
    shard.buffer.array[:] = data
    bounds = np.linspace(0, nbytes, nitems + 1).astype(int)
    for k, (a, b) in enumerate(itertools.pairwise(bounds)):
        algorithm = algorithms[k % len(algorithms)]
        shard.add_item(ManifestItem(key=f"item{k}", offset=int(a), nbytes=int(b - a),
                                    checksum=digest_item(shard.buffer.array[a:b], algorithm), kind="bytes",
                                    algorithm=digests.recorded_as(algorithm)))
    return shard.commit(world_size=1, save_id=f"{run_id}-{step}-{seed}", run_id=run_id)


def write_status(status_dir: str, name: str, obj: dict) -> None:
    path = os.path.join(status_dir, name)
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    import torch.distributed as dist

    from mlcheckpoint.replication import Rendezvous, ReplicationError
    from mlcheckpoint.replication.tcp.transport import TcpTransport
    from mlcheckpoint.settings import ReplicationOptions, tuned

    store = LocalStore(cfg["dir"], cfg["job"])
    if cfg["cmd"] == "push":
        make_shard(store, cfg["step"], cfg["rank"], cfg["nbytes"], cfg.get("seed", 0))
    c10d = dist.TCPStore(cfg["host"], cfg["port"], is_master=False)
    rdzv = Rendezvous(c10d, cfg["job"], cfg["rank"], cfg["world"], timeout=120)
    options = ReplicationOptions(host="127.0.0.1", timeout=cfg.get("timeout", 60),
                                 streams=cfg.get("streams", 1), bandwidth=cfg.get("bandwidth", 0))
    with tuned(min_stripe_bytes=cfg.get("min_stripe_bytes", 64 << 20)):
        transport = TcpTransport(store, rdzv, options)
    write_status(cfg["status_dir"], f"{cfg['rank']}.ready", {"address": transport.address,
                                                              "pid": os.getpid()})
    if cfg["cmd"] == "serve":
        sys.stdin.read()  # the test closes our stdin to end us gracefully
    elif cfg["cmd"] == "replicate":
        from mlcheckpoint.replication import Replicator
        from mlcheckpoint.topology import Topology
        rank, per_node = cfg["rank"], cfg["per_node"]
        topology = Topology(rank=rank, world_size=cfg["world"], local_rank=rank % per_node,
                            local_world_size=per_node, node_rank=rank // per_node,
                            num_nodes=cfg["nodes"])
        rep = Replicator(store, transport, rdzv, topology, poll_interval=0.05)
        for line in sys.stdin:
            m = make_shard(store, int(line), rank, cfg["nbytes"])
            rep.notify(m.step, m.save_id)
            write_status(cfg["status_dir"], f"{rank}.saved-{m.step}", {"save_id": m.save_id})
        rep.close()
    elif cfg["cmd"] == "push":
        try:
            sent = transport.push_shard(cfg["peer"], cfg["step"], cfg["rank"])
            result = {"ok": True, "bytes": sent}
        except ReplicationError as e:
            result = {"ok": False, "error": str(e)}
        result["bytes_sent"] = transport.budget.bytes_sent
        write_status(cfg["status_dir"], f"{cfg['rank']}.result", result)
    transport.close()


if __name__ == "__main__":
    main()

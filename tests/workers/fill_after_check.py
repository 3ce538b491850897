"""Worker (plain process): another program fills the tmpfs right after the capacity check.

argv: <tmpfs dir> <scenario>   scenario = shard | replica | prewarm
Prints one JSON line with what happened. Run in a process of its own: before the fix, the
first touch of an unreserved page kills the process with SIGBUS, and the test sees that exit
(-7) instead of a report.
"""

import json
import os
import socket
import sys
import threading
from typing import Any

import numpy as np

from mlcheckpoint import CapacityError
from mlcheckpoint.integrity.checksum import checksum
from mlcheckpoint.replication.core.sink import ReceiveSink
from mlcheckpoint.replication.tcp import protocol as p
from mlcheckpoint.store import LocalStore, layout
from mlcheckpoint.store.manifest import Manifest, ManifestItem

MiB = 1 << 20
SHARD = 6 * MiB


def fill_after_check(store: LocalStore, leave: int) -> None:
    """From now on, every capacity check that passes is followed at once by another program's
    file that leaves only ``leave`` bytes free: the race between the check and the copy."""
    check = store.capacity.preflight
    filler = os.path.join(store.local_dir, "other-program.bin")

    def check_then_fill(nbytes: int, reusable: int, **where: Any) -> None:
        check(nbytes, reusable, **where)
        if not os.path.exists(filler):
            vfs = os.statvfs(store.local_dir)
            fd = os.open(filler, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.posix_fallocate(fd, 0, vfs.f_bavail * vfs.f_frsize - leave)
            finally:
                os.close(fd)

    store.capacity.preflight = check_then_fill  # type: ignore[method-assign]


def committed_step(store: LocalStore, step: int) -> bytes:
    data = np.random.default_rng(step).integers(0, 256, MiB, dtype=np.uint8)
    sw = store.begin_shard(step, 0, data.nbytes)
    sw.buffer.array[:] = data
    sw.add_item(ManifestItem("w", 0, data.nbytes, checksum(data)))
    sw.commit()
    store.metadata.write(step, b"meta", world_size=1, ranks=[0], total_bytes=data.nbytes)
    return data.tobytes()


def leftovers(store: LocalStore) -> list[str]:
    """Files of the job besides the committed step 1 and the locks."""
    out = []
    for root, _dirs, files in os.walk(store.job_dir):
        out += [os.path.relpath(os.path.join(root, f), store.job_dir) for f in files
                if layout.classify(f).kind is not layout.Kind.LOCK]
    keep = {os.path.relpath(p, store.job_dir) for p in (
        store.paths.data(1, 0), store.paths.manifest(1, 0), store.paths.metadata(1))}
    return sorted(set(out) - keep)


def shard_scenario(store: LocalStore) -> dict:
    sw = store.begin_shard(2, 0, SHARD)
    sw.buffer.array[:] = 1  # before the fix: SIGBUS here
    sw.abort()
    return {"outcome": "written"}


def replica_scenario(store: LocalStore) -> dict:
    """A replica pushed by the partner arrives while the tmpfs is full (real socket)."""
    data = np.full(SHARD, 7, dtype=np.uint8)
    m = Manifest(job_id=store.job_id, step=2, rank=1, data_bytes=SHARD,
                 items=[ManifestItem("w", 0, SHARD, checksum(data))])
    receiver, sender = socket.socketpair()

    def push() -> None:
        try:
            sender.sendall(data)
        except OSError:
            pass  # the receiver refused and closed: what a refused replica looks like
        finally:
            sender.close()

    t = threading.Thread(target=push, daemon=True)
    t.start()
    try:
        with ReceiveSink(store).begin(m) as receipt:  # as the TCP listener receives a replica
            p.recv_into_exact(receiver, receipt.array.data, receipt.landed)
            receipt.commit()
        return {"outcome": "received"}
    finally:
        receiver.close()
        t.join(timeout=30)


def prewarm_scenario(store: LocalStore) -> dict:
    made = store.pool.prewarm(0, SHARD // 4, keep=2)
    return {"outcome": "prewarmed", "made": made}


def main() -> None:
    local_dir, scenario = sys.argv[1], sys.argv[2]
    store = LocalStore(local_dir, "job-fill")
    step1 = committed_step(store, 1)
    fill_after_check(store, leave=MiB)
    report = {}
    try:
        report = {"shard": shard_scenario, "replica": replica_scenario,
                  "prewarm": prewarm_scenario}[scenario](store)
    except CapacityError as e:
        report = {"outcome": "CapacityError", "message": str(e), "needed": e.needed,
                  "available": e.available}
    report["leftovers"] = leftovers(store)
    report["step_dirs"] = len(os.listdir(store.steps_dir))
    with open(store.paths.data(1, 0), "rb") as f:
        report["step1_intact"] = f.read() == step1
    report["complete"] = store.inventory.complete_steps()
    # Once the other program is gone, the store takes a shard of that size again.
    del store.capacity.preflight
    os.unlink(os.path.join(local_dir, "other-program.bin"))
    sw = store.begin_shard(3, 0, SHARD)
    sw.buffer.array[:] = 3
    sw.add_item(ManifestItem("w", 0, SHARD, checksum(sw.buffer.array)))
    sw.commit()
    with open(store.paths.data(3, 0), "rb") as f:
        report["after"] = len(f.read()) if store.shards.read_manifest(3, 0).data_bytes == SHARD else -1
    store.close()
    print(json.dumps(report))


if __name__ == "__main__":
    main()

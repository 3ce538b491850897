"""Worker for the emulated cluster (tests/jobs/test_netcluster.py): resume, then save steps
[first, last] over TCP replication, each step replicated before the next is saved.

argv: first last [hold] ; hold: after reporting, sleep until killed (a job still running when
its node is lost).

Reports "resume" {step, source, sources, reason, bytes_fetched, match, mismatch, digests,
address} and "saved" {digests: {step: ...}, protected: {step: bool}, address}, where digests
are sha256 of every tensor's raw bytes (bit-exact, NaN and -0.0 included) and address is the
one this rank's replication listener bound.
"""

import hashlib
import sys
import time

import torch
import torch.distributed as dist
from common import init, report
from states import differences, make_state, zeros_like_state

from mlcheckpoint import CheckpointManager
from mlcheckpoint.testing import internals


def state(rank: int, step: int, world: int) -> dict:
    """make_state(step, rank) plus a few MB, so that the shards take a while on a shaped link."""
    g = torch.Generator().manual_seed(5000 + step)  # replicated: equal on every rank
    r = torch.Generator().manual_seed(9000 + 100 * step + rank)
    sd = make_state(step, rank)
    sd["big_shared"] = torch.randn(1 << 18, generator=g)  # 1 MiB, saved once
    sd[f"big_rank{rank}"] = torch.randn(1 << 20, generator=r)  # 4 MiB of this rank's own
    return sd


def digests(sd, path: str = "") -> dict[str, str]:
    if isinstance(sd, torch.Tensor):
        raw = sd.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return {path: f"{sd.dtype}{list(sd.shape)}:{hashlib.sha256(raw).hexdigest()}"}
    if isinstance(sd, dict):
        return {k: v for key, val in sd.items() for k, v in digests(val, f"{path}/{key}").items()}
    return {}


def main() -> None:
    first, last = int(sys.argv[1]), int(sys.argv[2])
    hold = len(sys.argv) > 3 and sys.argv[3] == "hold"
    rank, world = init()
    ckpt = CheckpointManager(replication="tcp")
    replicator = internals(ckpt).replicator
    address = getattr(replicator.transport, "address", None) if replicator else None

    sd = zeros_like_state(state(rank, 0, world))
    info = ckpt.resume(sd)
    mismatch = [] if info.step is None else differences(state(rank, info.step, world), sd)
    report("resume", {"step": info.step, "source": info.source, "sources": info.sources,
                      "reason": info.reason, "bytes_fetched": info.bytes_fetched,
                      "match": not mismatch, "mismatch": mismatch, "address": address,
                      "digests": digests(sd) if info.step is not None else {}})

    saved, protected = {}, {}
    for step in range(first, last + 1):
        sd = state(rank, step, world)
        ckpt.save(sd, step)
        saved[step] = digests(sd)
        # Replicated before the next save: which step is newest on two nodes is then fixed.
        protected[step] = ckpt.wait_replicated(step, 60)
    ckpt.wait()
    report("saved", {"digests": saved, "protected": protected, "address": address})
    while hold:  # the test loses this node (or stops the job) from outside
        time.sleep(1)
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

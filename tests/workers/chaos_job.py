"""Worker for the randomized fault test (tests/jobs/test_chaos.py): resume, check, save until killed.

argv[1]: JSON {"round", "steps", "seed", "async", "ack", "ack_timeout", "compute"}
    round    this launch's number: every step it saves is of incarnation ``round``
    steps    steps saved after the resume (the budget); then the job closes and exits 0
    seed     with ``round``, picks save or async_save (probability ``async``), whether to
             wait for replication after a save (probability ``ack``, at most ``ack_timeout``
             seconds) and the time spent "training" before the next save (at most ``compute``
             seconds): the same choices on every rank
env CHAOS_CRASH_NODE / CHAOS_CRASH_AT: on that node only, MLCHECKPOINT_CRASH_AT is set to
    CHAOS_CRASH_AT; "<point>@+k" names the k-th step saved after the resume, and a point
    without a step is armed from the start (so it may fire during the resume's fetches).

The state is a pure function of (step, incarnation, rank): after a rollback the job saves the
same step numbers again with other bytes, as a real job does, so copies of "step S" from two
incarnations must never be mixed or mistaken for each other.

Writes, in $TEST_OUT_DIR (outside every node's local_dir, so it survives wipes):
    chaos-r<round>.rank<k>.json  the resume: step, incarnation, source, exact match, digest
    chaos-progress.rank<k>.txt   append-only lines "<round> <event> <step> <time>": pid, resume,
        resumed, save (about to save step), saved (save returned), ack / noack (wait_replicated
        returned True / False), closed
"""

import hashlib
import json
import os
import random
import sys
import time

import torch
import torch.distributed as dist
from common import init, report
from states import differences

from mlcheckpoint import CheckpointManager, ReplicationOptions

BIG = 1 << 18  # float32 items of the per-rank tensor: ~1 MiB per shard, replication takes a while


def chaos_state(step: int, inc: int, rank: int) -> dict:
    """What a rank saves at ``step`` in incarnation ``inc`` (several dtypes, a view, a
    replicated tensor DCP writes once, non-tensor values)."""
    shared = torch.Generator().manual_seed(100_003 * step + 17 * inc)
    mine = torch.Generator().manual_seed(100_003 * step + 17 * inc + 7919 * (rank + 1))
    return {
        "shared": {  # equal on every rank: de-duplicated on save, read from one shard
            "w": torch.randn(48, 40, generator=shared),
            "b16": torch.randn(300, generator=shared).to(torch.bfloat16),
        },
        "extra": {"step": step, "inc": inc, "tag": f"s{step}-i{inc}"},
        f"rank{rank}": {
            "big": torch.randn(BIG, generator=mine),
            "i64": torch.randint(-2**40, 2**40, (77,), generator=mine, dtype=torch.int64),
            "u8": torch.randint(0, 256, (333,), generator=mine, dtype=torch.uint8),
            "view": torch.randn(24, 16, generator=mine).t(),  # non-contiguous
            "meta": {"step": step, "inc": inc},
        },
    }


def template(rank: int) -> dict:
    """What resume loads into: the right shapes and dtypes, no values of any step."""
    def blank(v):
        if isinstance(v, torch.Tensor):
            return torch.zeros_like(v)
        if isinstance(v, dict):
            return {k: blank(x) for k, x in v.items()}
        return -1 if isinstance(v, int) else ""
    return blank(chaos_state(0, 0, rank))


def digest(v, h=None) -> str:
    """A digest of every tensor byte and non-tensor value, in key order."""
    h = h or hashlib.sha256()
    if isinstance(v, torch.Tensor):
        h.update(str((v.dtype, tuple(v.shape))).encode())
        h.update(v.contiguous().view(torch.uint8).numpy().tobytes())
    elif isinstance(v, dict):
        for k in sorted(v):
            h.update(repr(k).encode())
            digest(v[k], h)
    else:
        h.update(repr(v).encode())
    return h.hexdigest()


class Progress:
    """This rank's append-only event log; one write() per line, so a SIGKILL leaves whole
    lines only (the reader also ignores an unterminated last line)."""

    def __init__(self, rank: int, rnd: int):
        path = os.path.join(os.environ["TEST_OUT_DIR"], f"chaos-progress.rank{rank}.txt")
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self.rnd = rnd

    def __call__(self, event: str, step: int | None = None) -> None:
        line = f"{self.rnd} {event} {-1 if step is None else step} {time.time():.3f}\n"
        os.write(self.fd, line.encode())


def arm_crash_point(first_step: int | None = None) -> None:
    """Set this node's crash point: before the resume (``first_step`` None) one without a
    step; after it one relative to ``first_step``, the first step this launch saves."""
    spec = os.environ.get("CHAOS_CRASH_AT")
    if not spec or int(os.environ.get("CHAOS_CRASH_NODE", "-1")) != int(os.environ["GROUP_RANK"]):
        return
    point, _, rel = spec.partition("@+")
    if not rel and first_step is None:
        os.environ["MLCHECKPOINT_CRASH_AT"] = point
    elif rel and first_step is not None:
        os.environ["MLCHECKPOINT_CRASH_AT"] = f"{point}@{first_step + int(rel) - 1}"


def train(sd: dict) -> None:
    """Change every tensor of the live state in place, as the next training step would."""
    for v in sd.values():
        if isinstance(v, torch.Tensor):
            v.add_(1)
        elif isinstance(v, dict):
            train(v)


def check_resume(info, sd: dict, rank: int) -> dict:
    """Is what was loaded exactly what this rank saved at the reported step?"""
    out = {"step": info.step, "source": info.source, "sources": info.sources,
           "reason": info.reason, "bytes_fetched": info.bytes_fetched}
    if info.step is None:
        return dict(out, inc=None, match=True, mismatch=[])
    inc = sd[f"rank{rank}"]["meta"]["inc"]
    expected = chaos_state(info.step, inc, rank)
    mismatch = differences(expected, sd)
    return dict(out, inc=inc, extra_inc=sd["extra"]["inc"], match=not mismatch,
                mismatch=mismatch, digest=digest(sd), shared_digest=digest(sd["shared"]))


def main() -> None:
    cfg = json.loads(sys.argv[1])
    rnd = int(cfg["round"])
    rank, _ = init()
    progress = Progress(rank, rnd)
    arm_crash_point()
    progress("pid", os.getpid())  # the test watches for this rank's death
    ckpt = CheckpointManager(keep=2, replication=ReplicationOptions(timeout=10.0))
    sd = template(rank)
    progress("resume")
    info = ckpt.resume(sd)
    report(f"chaos-r{rnd}", dict(check_resume(info, sd, rank), round=rnd))
    progress("resumed", info.step)
    step = 1 if info.step is None else info.step + 1
    arm_crash_point(step)

    choice = random.Random(f"{cfg['seed']}/{rnd}")  # same draws on every rank
    for _ in range(int(cfg["steps"])):
        use_async = choice.random() < float(cfg["async"])
        wait_ack = choice.random() < float(cfg["ack"])
        progress("save", step)
        sd = chaos_state(step, rnd, rank)
        if use_async:
            ckpt.async_save(sd, step)
        else:
            ckpt.save(sd, step)
        train(sd)  # an async save must already hold its own copy
        progress("saved", step)
        if wait_ack:
            acked = ckpt.wait_replicated(step, float(cfg["ack_timeout"]))
            progress("ack" if acked else "noack", step)
        step += 1
        time.sleep(choice.uniform(0, float(cfg["compute"])))  # training between saves
    ckpt.close()
    progress("closed")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

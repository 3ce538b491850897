#!/usr/bin/env python
"""Recovery benchmark: resume from local memory and from a peer, and the planner at scale.

    python benchmarks/bench_recovery.py [--size-gb 1.0] [--json out.json] [--quick]

Measured in one run on this machine:
  * baseline: DCP FileSystemReader loading the same state dict from /dev/shm (one process)
  * baseline: a raw single-stream loopback socket transfer of the same bytes
  * baseline: the same 2-rank job resuming from its persistent DCP checkpoint
    (FileSystemWriter/FileSystemReader) on /dev/shm, memory wiped on both nodes: stock DCP
    doing exactly the job ours does, under the same concurrency
  * resume from local memory: 2 simulated nodes x 1 rank (torchrun), every shard local
  * resume from peer: node 1 replaced by an empty machine; its rank reads its shard from
    node 0's replica (verifying it) into the model. Both simulated nodes share this machine's
    cores, so node 0's own local load competes with node 1's transfer, which it would not on
    two machines; a second job where node 0 has almost nothing to load shows the transfer
    alone ("peer, lopsided").
  * plan_resume() on simulated inventories of 1k, 4k and 16k ranks
Targets: local >= 10x FileSystemReader; peer >= 0.8x raw socket; planner < 1 s at 16k ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import uuid

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script from a checkout: import the package from it
    sys.path.insert(0, ROOT)

from benchmarks.harness.baselines import dcp_fs_load, dcp_fs_save, raw_socket_seconds
from benchmarks.harness.processes import (
    Helpers,
    free_port,
    make_workspace,
    torchrun_cmd,
)
from benchmarks.harness.stats import median, timed
from mlcheckpoint.recovery.inventory import NodeInventory, StepCopy
from mlcheckpoint.recovery.planner import plan_resume

THIS_FILE = os.path.abspath(__file__)


def flat_state(size: int, prefix: str = "", fill: int = 0) -> dict[str, torch.Tensor]:
    """A few large tensors and many small ones; ``prefix`` keys them per rank (each rank's own
    bytes), ``fill`` sets the large ones' values (a resume is checked against fill = rank)."""
    big = size // 5
    d = {f"{prefix}big{i}": torch.full((big // 4,), float(fill + i)) for i in range(4)}
    d.update({f"{prefix}small{i}": torch.full((size // 5 // 200 // 4,), float(i)) for i in range(200)})
    return d


def worker(mode: str, size: int, out: str) -> None:
    """One rank of the simulated job (under torchrun): save step 1, or resume it and check it."""
    import torch.distributed as dist

    from mlcheckpoint import CheckpointManager

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0 and os.environ.get("BENCH_LOPSIDED"):
        size //= 1024  # node 0 has (almost) nothing of its own to load
    ckpt = CheckpointManager(persistent_dir=os.environ.get("BENCH_PERSISTENT"))
    if mode == "save":
        ckpt.save(flat_state(size, f"r{rank}.", rank), 1, persistent=bool(os.environ.get("BENCH_PERSISTENT")))
        result: dict = {"protected": ckpt.wait_replicated(1, 600)}
    else:
        sd = {k: torch.empty_like(v) for k, v in flat_state(size, f"r{rank}.").items()}
        for t in sd.values():
            t.fill_(-1)  # touch the destination, as a real model's parameters are
        dist.barrier()
        info = ckpt.resume(sd)
        ref = flat_state(size, f"r{rank}.", rank)
        result = {"step": info.step, "source": info.sources.get(rank), "seconds": info.seconds,
                  "bytes_fetched": info.bytes_fetched, "exact": all(torch.equal(sd[k], ref[k]) for k in ref)}
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    ckpt.close()
    dist.destroy_process_group()


def run_job(root: str, job: str, mode: str, size: int, dirs: list[str],
            env: dict[str, str] | None = None) -> dict[int, dict]:
    """A job of one torchrun agent per directory in ``dirs`` (a simulated node each)."""
    port, out = free_port(), os.path.join(root, f"out-{mode}-{uuid.uuid4().hex[:4]}")
    helpers = Helpers(root)
    try:
        procs = [helpers.spawn(torchrun_cmd(THIS_FILE, ["--_worker", mode, str(size), out], nnodes=len(dirs),
                                            node_rank=k, port=port),
                               f"{mode}-{os.path.basename(out)}-node{k}",
                               env={"MLCHECKPOINT_LOCAL_DIR": d, "MLCHECKPOINT_JOB_ID": job, **(env or {})})
                 for k, d in enumerate(dirs)]
        helpers.wait(procs, timeout=900)
    finally:
        helpers.close()
    results = {}
    for k in range(len(dirs)):
        with open(f"{out}.{k}") as f:
            results[k] = json.load(f)
    return results


def bench_filesystem_reader(root: str, size: int, reps: int) -> float:
    sd = flat_state(size)
    path = os.path.join(root, "fs-ckpt")
    dcp_fs_save(sd, path)
    target = {k: torch.empty_like(v).fill_(-1) for k, v in sd.items()}
    times = [timed(lambda: dcp_fs_load(target, path))[0] for _ in range(reps)]
    shutil.rmtree(path)
    return median(times)


def bench_raw_socket(root: str, size: int, reps: int) -> float:
    """Single stream over loopback: sendall from memory, recv_into a warm buffer."""
    return median(raw_socket_seconds(size, root, reps, how="sendall"))


def bench_planner(ranks_per_node: int = 8) -> dict[int, float]:
    out = {}
    for world in (1024, 4096, 16384):
        nnodes = world // ranks_per_node
        nodes = []
        for n in range(nnodes):
            ranks = list(range(n * ranks_per_node, (n + 1) * ranks_per_node))
            partner = n ^ 1
            owners = ranks + list(range(partner * ranks_per_node, (partner + 1) * ranks_per_node))
            copy = StepCopy(frozenset(owners), True, tuple(range(world)), world,
                            tuple((o, 1 << 30) for o in sorted(owners)))
            nodes.append(NodeInventory(n, ranks, {} if n == 3 else {98: copy, 99: copy}))
        out[world], d = timed(lambda nodes=nodes, world=world: plan_resume(nodes, 50, world))
        assert d.step == 99 and len([f for f in d.fetches if f.owner is not None]) == ranks_per_node
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gb", type=float, default=1.0, help="checkpoint bytes per rank")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.size_gb, args.reps = 0.05, 1
    size = int(args.size_gb * (1 << 30)) // (1 << 20) * (1 << 20)
    root = make_workspace("mlckpt-bench-recovery-")
    gb = size / 1e9
    res: dict = {"bytes_per_rank": size, "cores": os.cpu_count(), "torch": torch.__version__}
    try:
        res["filesystem_reader_s"] = bench_filesystem_reader(root, size, args.reps)
        res["raw_socket_s"] = bench_raw_socket(root, size, args.reps)
        dirs = [os.path.join(root, f"node{k}") for k in range(2)]
        for d in dirs:
            os.makedirs(d)
        job = f"bench-{uuid.uuid4().hex[:6]}"
        persistent = {"BENCH_PERSISTENT": os.path.join(root, "persistent")}
        saved = run_job(root, job, "save", size, dirs, persistent)
        assert all(r["protected"] for r in saved.values()), saved
        local, from_fs, peer, lopsided = [], [], [], []
        for _ in range(args.reps):
            r = run_job(root, job, "resume", size, dirs, persistent)
            assert all(x["exact"] and x["source"] == "local" for x in r.values()), r
            local.append(max(x["seconds"] for x in r.values()))
        for _ in range(args.reps):  # memory gone on both nodes: stock DCP from /dev/shm
            wiped = [os.path.join(root, f"wiped{k}") for k in range(2)]
            for w in wiped:
                os.makedirs(w)
            r = run_job(root, job, "resume", size, wiped, persistent)
            assert all(x["exact"] and x["source"] == "persistent" for x in r.values()), r
            from_fs.append(max(x["seconds"] for x in r.values()))
            for w in wiped:
                shutil.rmtree(w)
        for _ in range(args.reps):
            shutil.rmtree(dirs[1])
            os.makedirs(dirs[1])
            r = run_job(root, job, "resume", size, dirs)
            assert r[1]["source"] == "peer" and all(x["exact"] for x in r.values()), r
            peer.append(r[1]["seconds"])
            res["peer_bytes_fetched"] = r[1]["bytes_fetched"]
        lop = {"BENCH_LOPSIDED": "1"}
        lop_dirs = [os.path.join(root, f"lop{k}") for k in range(2)]
        for d in lop_dirs:
            os.makedirs(d)
        saved = run_job(root, job + "-lop", "save", size, lop_dirs, lop)
        assert all(r["protected"] for r in saved.values()), saved
        for _ in range(args.reps):
            shutil.rmtree(lop_dirs[1])
            os.makedirs(lop_dirs[1])
            r = run_job(root, job + "-lop", "resume", size, lop_dirs, lop)
            assert r[1]["source"] == "peer" and all(x["exact"] for x in r.values()), r
            lopsided.append(r[1]["seconds"])
        res["resume_local_s"] = median(local)
        res["resume_persistent_s"] = median(from_fs)
        res["resume_peer_s"] = median(peer)
        res["resume_peer_lopsided_s"] = median(lopsided)
        res["planner_s"] = bench_planner()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    fsr, raw = res["filesystem_reader_s"], res["raw_socket_s"]
    loc, peer_s = res["resume_local_s"], res["resume_peer_s"]
    pers, lop_s = res["resume_persistent_s"], res["resume_peer_lopsided_s"]
    print(f"recovery benchmark: {size / 2**30:.2f} GiB per rank, 2 simulated nodes x 1 rank, "
          f"{res['cores']} cores, torch {res['torch']}; medians of {args.reps}")
    rows = [
        ("DCP FileSystemReader from /dev/shm, 1 process (baseline)", fsr, ""),
        ("resume from persistent DCP on /dev/shm, 2 ranks (baseline)", pers, ""),
        ("raw socket, single stream (baseline)", raw, ""),
        ("resume from local memory, 2 ranks", loc,
         f"{fsr / loc:.1f}x FileSystemReader, {pers / loc:.1f}x the same job via DCP FS"),
        ("resume from peer, node 1 replaced", peer_s, f"{raw / peer_s:.2f}x raw socket"),
        ("resume from peer, lopsided (node 0 idle)", lop_s, f"{raw / lop_s:.2f}x raw socket"),
    ]
    print(f"{'measurement':60s} {'seconds':>8s} {'GB/s':>7s}  ratio")
    for name, t, ratio in rows:
        print(f"{name:60s} {t:8.3f} {gb / t:7.2f}  {ratio}")
    for world, t in res["planner_s"].items():
        print(f"{'plan_resume, ' + str(world) + ' ranks':60s} {t:8.4f}")
    print("targets:")
    checks = {"local >= 10x FileSystemReader (1 process)": fsr / loc >= 10,
              "local >= 10x the same job resuming via DCP FS": pers / loc >= 10,
              "peer >= 0.8x raw socket (node 0 loading too)": raw / peer_s >= 0.8,
              "peer >= 0.8x raw socket (lopsided)": raw / lop_s >= 0.8,
              "planner < 1 s at 16k ranks": res["planner_s"][16384] < 1.0}
    for name, ok in checks.items():
        print(f"  {'PASS' if ok else 'FAIL'}  {name}")
    res["targets"] = checks
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--_worker":
        worker(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        main()

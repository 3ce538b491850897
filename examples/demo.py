"""Demo: a simulated 2-node job that checkpoints to memory, loses a node and recovers.

    python examples/demo.py [--nodes 2] [--ranks-per-node 2] [--steps 16] [--kill-at 8]

1. A reference run trains uninterrupted.
2. The same job runs again; at step --kill-at node 1 is SIGKILLed and its memory wiped (a
   replacement machine), and the scheduler stops node 0's workers (its tmpfs survives).
3. The job restarts on the same node ranks: node 1's ranks fetch their shards from node 0's
   replicas, everyone resumes, the run finishes.
4. Losses and final parameters are compared with the reference bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from mlcheckpoint import LocalStore

T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """One torchrun agent per simulated node, each with its own tmpfs directory."""

    def __init__(self, root: str, job_id: str, nodes: int, ranks: int, steps: int):
        self.root, self.job_id, self.nodes, self.ranks, self.steps = root, job_id, nodes, ranks, steps
        self.dirs = [os.path.join(root, "mem", f"node{k}") for k in range(nodes)]
        for d in self.dirs:
            os.makedirs(d, mode=0o700, exist_ok=True)
        self.procs: list[subprocess.Popen] = []

    def start(self, out: str, progress: str, step_delay: float = 0.0) -> None:
        port = free_port()
        self.procs = []
        for k in range(self.nodes):
            env = dict(os.environ, MLCHECKPOINT_LOCAL_DIR=self.dirs[k], MLCHECKPOINT_JOB_ID=self.job_id,
                       OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                       PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(HERE), os.environ.get("PYTHONPATH")])))
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={self.nodes}",
                   f"--node-rank={k}", f"--nproc-per-node={self.ranks}", "--master-addr=127.0.0.1",
                   f"--master-port={port}", "--max-restarts=0", os.path.join(HERE, "train_fsdp.py"),
                   "--steps", str(self.steps), "--out", out, "--progress", progress,
                   "--persistent-dir", os.path.join(self.root, "persistent", self.job_id),
                   "--persist-every", "5", "--step-delay", str(step_delay)]
            with open(os.path.join(self.root, f"{self.job_id}-node{k}.log"), "a") as log:
                self.procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                   start_new_session=True))

    def wait(self, timeout: float = 600) -> None:
        for k, p in enumerate(self.procs):
            if p.wait(timeout=timeout) != 0:
                raise SystemExit(f"node {k} failed; see {self.root}/{self.job_id}-node{k}.log")

    def kill(self, k: int, sig: int = signal.SIGKILL) -> None:
        """Signal node k's agent and all its ranks (torchrun puts ranks in their own sessions)."""
        p = self.procs[k]
        if p.poll() is None:
            for pid in process_tree(p.pid):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            p.wait(timeout=60)

    def holdings(self) -> str:
        parts = []
        for k, d in enumerate(self.dirs):
            store = LocalStore(d, self.job_id, create=False)
            inv = store.inventory()
            if not inv:
                parts.append(f"node {k}: empty")
                continue
            complete = [s for s, st in inv.items() if st.has_metadata and st.committed_ranks]
            newest = max(complete) if complete else max(inv)
            st = inv[newest]
            mine = set(range(k * self.ranks, (k + 1) * self.ranks))
            own = sorted(st.committed_ranks & mine)
            replicas = sorted(st.committed_ranks - mine)
            parts.append(f"node {k}: steps {sorted(inv)}; step {newest}: own shards of ranks {own}, "
                         f"replicas of ranks {replicas}{', metadata' if st.has_metadata else ''}")
        return "\n           ".join(parts)


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def read_progress(path: str) -> int:
    try:
        with open(path) as f:
            lines = f.read().split()
        return int(lines[-1]) if lines else -1
    except FileNotFoundError:
        return -1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--kill-at", type=int, default=6)
    ap.add_argument("--keep", action="store_true", help="keep the demo's files for inspection")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="mlcheckpoint-demo-", dir="/dev/shm")
    n, g = args.nodes, args.ranks_per_node
    try:
        say(f"reference run: {n} nodes x {g} ranks, {args.steps} steps, no failure")
        ref = Job(root, f"demo-ref-{uuid.uuid4().hex[:6]}", n, g, args.steps)
        ref.start(os.path.join(root, "ref.json"), os.path.join(root, "ref.progress"))
        ref.wait()
        say("reference run done")

        job = Job(root, f"demo-{uuid.uuid4().hex[:6]}", n, g, args.steps)
        progress = os.path.join(root, "run.progress")
        say(f"job {job.job_id}: {n} nodes x {g} ranks; async_save to RAM every step, overlapped "
            f"with the next step and replicated to the partner node; persistent DCP checkpoint "
            f"every 5 steps")
        job.start(os.path.join(root, "run.json"), progress, step_delay=0.3)
        while read_progress(progress) < args.kill_at:
            if any(p.poll() is not None for p in job.procs):
                raise SystemExit(f"job ended early; logs in {root}")
            time.sleep(0.05)
        step = read_progress(progress)
        say(f"step {step} trained; holdings:\n           {job.holdings()}")
        job.kill(1)
        say(f"node 1 LOST (SIGKILL of all its processes) after step {step}")
        shutil.rmtree(job.dirs[1], ignore_errors=True)
        os.makedirs(job.dirs[1], mode=0o700)
        say("node 1 replaced by an empty machine (its tmpfs is gone)")
        job.kill(0, signal.SIGTERM)
        say("scheduler stopped node 0's workers; node 0's tmpfs survives")
        say(f"holdings now:\n           {job.holdings()}")

        say("job restarted on the same node ranks")
        t_restart = time.monotonic()
        job.start(os.path.join(root, "run.json"), progress)
        job.wait()
        with open(os.path.join(root, "run.json")) as f:
            run = json.load(f)
        with open(os.path.join(root, "ref.json")) as f:
            ref_out = json.load(f)
        say(f"resumed step {run['resumed_from']} from {run['resume_source']} "
            f"(per rank: {run['resume_sources']}) in {run['resume_seconds']:.3f}s; "
            f"restart to finish: {time.monotonic() - t_restart:.1f}s")
        say(f"finished step {args.steps - 1}; holdings:\n           {job.holdings()}")
        same_losses = run["losses"] == ref_out["losses"]
        same_params = run["digest"] == ref_out["digest"]
        print()
        print(f"losses identical to the uninterrupted run:     {'YES' if same_losses else 'NO'}")
        print(f"parameters identical to the uninterrupted run: {'YES' if same_params else 'NO'}"
              f" (sha256 {run['digest'][:16]}...)")
        ok = same_losses and same_params and run["resumed_from"] is not None
        print("DEMO PASSED" if ok else f"DEMO FAILED (files kept in {root})")
        if not ok:
            args.keep = True
        return 0 if ok else 1
    finally:
        if args.keep:
            print(f"files kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

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
import signal
import sys
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from mlcheckpoint.store import LocalStore
from mlcheckpoint.testing.cluster import Cluster, signal_tree

T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


class Job:
    """One run of examples/train_fsdp.py on a simulated cluster (one torchrun agent per node,
    each with its own tmpfs directory)."""

    def __init__(self, name: str, nodes: int, ranks: int, steps: int):
        self.cluster = Cluster(nodes, ranks, job_id=f"{name}-{uuid.uuid4().hex[:6]}",
                               prefix="mlcheckpoint-demo-")
        self.job_id, self.root, self.ranks, self.steps = self.cluster.job_id, self.cluster.root, ranks, steps
        # The workers inherit PYTHONPATH: let them import this checkout's package.
        self.env = {"PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(HERE),
                                                                os.environ.get("PYTHONPATH")]))}

    def start(self, out: str, progress: str, step_delay: float = 0.0) -> None:
        self.cluster.start(os.path.join(HERE, "train_fsdp.py"), "--steps", str(self.steps),
                           "--out", out, "--progress", progress,
                           "--persistent-dir", self.cluster.persistent_dir,
                           "--persist-every", "5", "--step-delay", str(step_delay), env=self.env)

    def wait(self, timeout: float = 600) -> None:
        for k, code in enumerate(self.cluster.wait(timeout)):
            if code != 0:
                raise SystemExit(f"node {k} of {self.job_id} failed (exit code {code})")

    def holdings(self) -> str:
        parts = []
        for k, node in enumerate(self.cluster.nodes):
            store = LocalStore(node.local_dir, self.job_id, create=False)
            inv = store.inventory.all()
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

    def close(self, keep: bool) -> None:
        if keep:
            self.cluster.kill_all()
            print(f"files kept in {self.root}")
        else:
            self.cluster.close()


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
    ap.add_argument("--verbose", action="store_true",
                    help="also print how each rank's bytes were laid out (layout words: peer, copies)")
    args = ap.parse_args()
    n, g = args.nodes, args.ranks_per_node
    ref = Job("demo-ref", n, g, args.steps)
    job = Job("demo", n, g, args.steps)
    try:
        say(f"reference run: {n} nodes x {g} ranks, {args.steps} steps, no failure")
        ref_out_path = os.path.join(ref.root, "ref.json")
        ref.start(ref_out_path, os.path.join(ref.root, "ref.progress"))
        ref.wait()
        say("reference run done")

        progress, run_out_path = os.path.join(job.root, "run.progress"), os.path.join(job.root, "run.json")
        say(f"job {job.job_id}: {n} nodes x {g} ranks; async_save to RAM every step, overlapped "
            f"with the next step and replicated to the partner node; persistent DCP checkpoint "
            f"every 5 steps")
        job.start(run_out_path, progress, step_delay=0.3)
        while read_progress(progress) < args.kill_at:
            if len(job.cluster.running()) < n:
                raise SystemExit(f"job ended early at step {read_progress(progress)}")
            time.sleep(0.05)
        step = read_progress(progress)
        say(f"step {step} trained; holdings:\n           {job.holdings()}")
        job.cluster.nodes[1].kill()
        say(f"node 1 LOST (SIGKILL of all its processes) after step {step}")
        job.cluster.nodes[1].wipe()
        say("node 1 replaced by an empty machine (its tmpfs is gone)")
        node0 = job.cluster.nodes[0]
        t_stop = time.monotonic()
        if node0.proc is not None and node0.proc.poll() is None:
            signal_tree(node0.proc, signal.SIGTERM)
            node0.proc.wait(timeout=60)
        log0 = node0.log()
        waited = ("; on SIGTERM each rank flushed its part of the newest step to the persistent "
                  "folder, " + ("found node 1's ranks gone and left without waiting for their "
                                "parts" if ", gone (its replication listener" in log0 else
                                "and stayed MLCHECKPOINT_FLUSH_WAIT_FOR_PARTS seconds for node "
                                "1's parts, which never came")
                  if "staying up to" in log0 else "")
        say(f"scheduler stopped node 0's workers in {time.monotonic() - t_stop:.1f}s{waited}; "
            "node 0's tmpfs survives")
        say(f"holdings now:\n           {job.holdings()}")

        say("job restarted on the same node ranks")
        t_restart = time.monotonic()
        job.start(run_out_path, progress)
        job.wait()
        with open(run_out_path) as f:
            run = json.load(f)
        with open(ref_out_path) as f:
            ref_out = json.load(f)
        say(f"{run['resume_summary']}; restart to finish: {time.monotonic() - t_restart:.1f}s")
        if args.verbose:  # the layout words: how each rank's bytes were laid out
            say(f"per-rank sources: {run['resume_sources']}")
        say(f"finished step {args.steps - 1}; holdings:\n           {job.holdings()}")
        same_losses = run["losses"] == ref_out["losses"]
        same_params = run["digest"] == ref_out["digest"]
        print()
        print(f"losses identical to the uninterrupted run:     {'YES' if same_losses else 'NO'}")
        print(f"parameters identical to the uninterrupted run: {'YES' if same_params else 'NO'}"
              f" (sha256 {run['digest'][:16]}...)")
        ok = same_losses and same_params and run["resumed_from"] is not None
        print("DEMO PASSED" if ok else "DEMO FAILED")
        if not ok:
            args.keep = True
        return 0 if ok else 1
    except SystemExit as e:  # a run failed: say why, and keep its files to look at
        args.keep = True
        print(f"{e}; files kept in {job.root}\n{ref.cluster.logs()}\n{job.cluster.logs()}",
              file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        for j in (ref, job):
            j.close(keep=args.keep)


if __name__ == "__main__":
    sys.exit(main())

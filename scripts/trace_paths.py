#!/usr/bin/env python
"""Which library code a save and a resume run: files, functions, threads and the file pairs
that call each other both ways, on two simulated nodes of two ranks each.

Every process of the job installs a profile hook on every thread (``sys.setprofile`` and
``threading.setprofile``, before the manager starts any thread) that records each call into a
function of the ``mlcheckpoint`` package while a phase is traced: the function, the thread
that ran it, and the library file that called it (stepping over standard-library frames such
as ``contextlib`` and ``threading``, not over torch: a call that torch makes into us, DCP
driving our writer, names no library caller). The phases, every process tracing the same
window (a barrier on each side, but between ``call`` and ``heal``: each rank's own resume
returning ends its ``call``):

    save      ``CheckpointManager.async_save`` until the partner holds the bytes
              (``wait_replicated``), the second save of the run (the first one warms up)
    native    ``dcp.async_save(storage_writer=ckpt.storage_writer(step))`` until the same
    resume    a restarted job whose node 1 lost its memory: ``resume`` until the replaced
              node's shards are rebuilt (``ckpt.wait()``), the window issue 43 counted; and
              that window's two parts, with the heal carried on to its end:
      call    ``resume`` until it returns (the restart waits for this)
      heal    from there until the loaded step is protected again (``wait_replicated``): the
              rebuild, then the replicator's round that gives every item its places back

A rebuild's end is not the heal's: the round that protects the step again runs on the
replicator's thread, and how much of it falls inside the first window depends on timing. The
window is kept to compare with the figures counted before (it ends at the rebuild whether or
not the step is then protected again); ``call`` and ``heal`` split the work at a point every
version reaches, and the report says whether the step was protected again within ``WAIT_S``.

The report is the union over all processes of each phase: how many library files and
functions ran (every code object Python calls counts as a function: comprehensions,
generator expressions and lambdas too, though Python 3.12 inlines list, dict and set
comprehensions; ``defined`` counts only the functions written with ``def``, so that figure
reads the same on every Python), which threads (numbered names folded:
``mlcheckpoint-copy_3`` counts as ``mlcheckpoint-copy``), and which pairs of files call each
other in both directions.

    python scripts/trace_paths.py                 # prints the table; --json FILE writes it
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

# What the tracer records, and the rows made of it: ``resume`` (the window issue 43 counted)
# is call + rebuild, ``heal`` rebuild + round.
RECORDED = ("save", "native", "call", "rebuild", "round")
ROWS = {"save": ("save",), "native": ("native",), "resume": ("call", "rebuild"),
        "call": ("call",), "heal": ("rebuild", "round")}
WAIT_S = 120  # the bound of every wait_replicated here, the heal's included
# qualname parts of code that no ``def`` names (not counted in ``defined``)
ANONYMOUS = re.compile(r"<(listcomp|dictcomp|setcomp|genexpr|lambda)>")


# --------------------------------------------------------------------------- the hook
class PathTracer:
    """Records the library calls of every thread while ``phase`` is set."""

    def __init__(self, package_dir: str):
        self.prefix = package_dir.rstrip(os.sep) + os.sep
        self.stdlib = os.path.dirname(os.__file__) + os.sep
        self.phase: str | None = None
        self.calls: dict[str, set[tuple[str, str]]] = {p: set() for p in RECORDED}
        self.edges: dict[str, set[tuple[str, str]]] = {p: set() for p in RECORDED}
        self.threads: dict[str, set[str]] = {p: set() for p in RECORDED}

    def install(self) -> None:
        sys.setprofile(self)
        threading.setprofile(self)

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        phase = self.phase
        if phase is None or event != "call":
            return
        filename = frame.f_code.co_filename
        if not filename.startswith(self.prefix):
            return
        callee = filename[len(self.prefix):]
        self.calls[phase].add((callee, frame.f_code.co_qualname))
        self.threads[phase].add(re.sub(r"[_-]?\d+$", "", threading.current_thread().name))
        caller = self._library_caller(frame.f_back)
        if caller is not None and caller != callee:
            self.edges[phase].add((caller, callee))

    def _library_caller(self, frame: Any) -> str | None:
        while frame is not None:
            filename = frame.f_code.co_filename
            if filename.startswith(self.prefix):
                return filename[len(self.prefix):]
            if not filename.startswith(self.stdlib):
                return None  # torch (or another package) called us
            frame = frame.f_back
        return None

    def result(self) -> dict[str, Any]:
        return {p: {"calls": sorted(self.calls[p]), "edges": sorted(self.edges[p]),
                    "threads": sorted(self.threads[p])} for p in RECORDED}


# --------------------------------------------------------------------------- the job
def worker(run: str) -> None:
    import mlcheckpoint

    tracer = PathTracer(os.path.dirname(mlcheckpoint.__file__))
    tracer.install()  # before the manager starts its threads: they inherit the hook

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from mlcheckpoint.testing.cluster import write_result

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    native_group = dist.new_group(backend="gloo")
    torch.manual_seed(rank)
    # Each rank its own tensors (as FSDP's shards are): every shard is replicated.
    sd: dict[str, Any] = {f"layer{i}.rank{rank}": torch.randn(256, 256) for i in range(4)}
    sd["step"] = 0

    def every_rank_to(phase: str | None) -> None:
        """The next phase, once every rank of the job is here (what runs meanwhile counts in
        the phase before)."""
        dist.barrier()
        tracer.phase = phase

    ckpt = mlcheckpoint.CheckpointManager(keep=2)
    if run == "first":
        ckpt.resume(sd)
        ckpt.async_save(sd, 1).result()  # warms buffers and connections up
        assert ckpt.wait_replicated(1, timeout=WAIT_S)
        every_rank_to("save")
        ckpt.async_save(sd, 2).result()
        assert ckpt.wait_replicated(2, timeout=WAIT_S)
        every_rank_to("native")
        dcp.async_save(sd, storage_writer=ckpt.storage_writer(3),
                       process_group=native_group).result()
        assert ckpt.wait_replicated(3, timeout=WAIT_S)
        every_rank_to(None)
        protected = None
    else:
        every_rank_to("call")
        info = ckpt.resume(sd)
        tracer.phase = "rebuild"  # this rank's own point, no barrier: nothing goes uncounted
        ckpt.wait()
        every_rank_to("round")
        assert info.step is not None, info
        protected = ckpt.wait_replicated(info.step, timeout=WAIT_S)
        every_rank_to(None)
    ckpt.close()
    write_result(f"trace-{run}", rank, {"phases": tracer.result(), "protected": protected})
    dist.destroy_process_group()


def measure() -> dict[str, Any]:
    from mlcheckpoint.testing.cluster import Cluster

    script = os.path.abspath(__file__)
    gathered: dict[str, list[dict]] = {}
    with Cluster(nnodes=2, nproc=2) as cluster:
        cluster.start(script, "--worker", "first")
        cluster.wait(timeout=600)
        first = cluster.results("trace-first")
        cluster.nodes[1].wipe()  # node 1 comes back empty
        cluster.start(script, "--worker", "second")
        cluster.wait(timeout=600)
        second = cluster.results("trace-second")
        gathered = {"first": list(first.values()), "second": list(second.values())}
    out: dict[str, Any] = {"protected_again": all(r["protected"] for r in gathered["second"])}
    for row, recorded in ROWS.items():
        per_rank = [r["phases"][p] for run in gathered.values() for r in run for p in recorded]
        calls = {tuple(c) for r in per_rank for c in r["calls"]}
        edges = {tuple(e) for r in per_rank for e in r["edges"]}
        both_ways = sorted({tuple(sorted(e)) for e in edges if (e[1], e[0]) in edges})
        out[row] = {"files": len({f for f, _ in calls}), "functions": len(calls),
                    "defined": sum(1 for _, fn in calls if not ANONYMOUS.search(fn)),
                    "threads": sorted({t for r in per_rank for t in r["threads"]}),
                    "both_ways": [list(p) for p in both_ways],
                    "file_list": sorted({f for f, _ in calls}),
                    # (to compare two runs function by function)
                    "function_list": sorted(f"{f}:{fn}" for f, fn in calls)}
    return out


def report(figures: dict[str, Any]) -> None:
    names = {"save": "async_save until the partner holds the bytes",
             "native": "dcp.async_save(storage_writer=...) until the same",
             "resume": "resume with one node replaced, until rebuilt",
             "call": "  resume() until it returns",
             "heal": "  then until the step is protected again"}
    print(f"{'path':50} {'files':>5} {'functions':>9} {'defined':>7} {'threads':>7} "
          f"{'both-way pairs':>14}")
    for row in ROWS:
        f = figures[row]
        print(f"{names[row]:50} {f['files']:5d} {f['functions']:9d} {f['defined']:7d} "
              f"{len(f['threads']):7d} {len(f['both_ways']):14d}")
    print(f"\nthe loaded step protected again within {WAIT_S} s: "
          f"{'yes' if figures['protected_again'] else 'NO'}")
    for row in ROWS:
        f = figures[row]
        print(f"\n{row}: threads {', '.join(f['threads'])}")
        for a, b in f["both_ways"]:
            print(f"  both ways: {a} <-> {b}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", choices=("first", "second"), help=argparse.SUPPRESS)
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return {}
    figures = measure()
    report(figures)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    return figures


if __name__ == "__main__":
    main()

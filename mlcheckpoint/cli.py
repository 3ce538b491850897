"""``mlcheckpoint`` command line: ls | verify | gc | history | bench.

Each command looks at this node's tmpfs (``--local-dir``, before or after the command; default
MLCHECKPOINT_LOCAL_DIR or /dev/shm/mlcheckpoint). Tables for people by default, ``--json`` for
scripts. Output into a pipe that closes early (``| head``) ends quietly with status 141, as a
Unix tool killed by SIGPIPE does.

Exit codes, ordered by severity (a script may test ``status >= EXIT_CORRUPT``); ``verify``
returns the worst it found:

    0  ok          every checksum of the step verified, and a resume could load it from this
                   node alone (the planner's verdict: ``manager/listing.py`` ``verdicts_here``)
    1  incomplete  what is here is intact, but some ranks' items or the metadata live on other
                   nodes (or another run of the job saved the step: a resume sets it aside)
    2  not found   no such job or step on this node (also a bad argument or setting)
    3  corrupt     bytes here fail their checksum, or a shard here is damaged: a resume
                   refuses this copy

``gc`` never deletes anything of a job directory that a live run holds (the run's claim,
``store/claim.py``): it names that run and exits with

    4  in use      a live run holds a job directory: it was left as it is
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

from . import history
from ._messages import plural
from .errors import CopyId, CorruptShardError, MLCheckpointError, ShardNotFoundError
from .manager.listing import HERE, INCOMPLETE, step_labels, verdicts_here
from .manager.retention import apply_retention
from .persistent import PersistentStorage
from .recovery.planner import StepVerdict
from .settings import BY_NAME, resolve_local_dir, validate_job_id
from .store import LocalStore
from .store.claim import Claimant, finished, unclaimed
from .store.claim import holder as claim_holder
from .store.layout import STEPS, ItemLocation
from .store.manifest import item_locations

EXIT_OK, EXIT_INCOMPLETE, EXIT_NOT_FOUND, EXIT_CORRUPT = 0, 1, 2, 3  # by severity
EXIT_IN_USE = 4  # gc: a live run holds a job directory, which was left as it is
VERDICTS = {EXIT_OK: "ok", EXIT_INCOMPLETE: "incomplete", EXIT_NOT_FOUND: "not found",
            EXIT_CORRUPT: "corrupt"}
EXIT_CODES_HELP = ("exit status, by severity: 0 ok, 1 incomplete on this node (the rest "
                   "intact), 2 job or step not found, 3 corrupt")
EXIT_CLOSED_PIPE = 128 + signal.SIGPIPE  # what a shell reports for a tool that SIGPIPE ended


def _size(nbytes: int | None) -> str:
    if nbytes is None:
        return "-"
    n = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _table(rows: list[list[Any]], header: list[str]) -> str:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def _jobs(local_dir: str, job: str | None) -> list[str]:
    if job is not None:
        return [validate_job_id(job)]
    try:
        return sorted(d for d in os.listdir(local_dir) if os.path.isdir(os.path.join(local_dir, d, STEPS)))
    except FileNotFoundError:
        return []


def _store(args, job: str) -> LocalStore:
    store = LocalStore(args.local_dir, job, create=False)
    if not os.path.isdir(store.job_dir):
        raise ShardNotFoundError(f"no job {job!r} under {args.local_dir}")
    return store


def cmd_ls(args) -> int:
    out = []
    for job in _jobs(args.local_dir, args.job):
        store = _store(args, job)
        steps: list[dict[str, Any]] = []
        events = history.read(store.job_dir)
        inventory = store.inventory.all()
        verdicts = verdicts_here(store, listed=inventory)  # what a resume from this node alone would decide
        replicated = {e["step"] for e in events if e["event"] == "replicate" and e.get("step") is not None}
        labels = step_labels(verdicts, replicated)
        for step, st in inventory.items():
            sizes = {}
            for r in sorted(st.committed_ranks):
                try:
                    sizes[r] = store.shards.read_manifest(step, r).held_bytes
                except MLCheckpointError:
                    pass
            verdict = verdicts.get(step, StepVerdict(False))  # (no usable metadata of it here)
            steps.append({"step": step, "state": labels.get(step, INCOMPLETE),
                          "metadata": st.has_metadata, "shards_here": sorted(st.committed_ranks),
                          "partial_here": sorted(set(st.partial) & st.committed_ranks),
                          "missing_here": list(verdict.missing), "why": verdict.reason or None,
                          "world_size": st.world_size,
                          "checkpoint_bytes": st.total_bytes, "bytes_here": sum(sizes.values())})
        for s in steps:
            s["replicated_from_here"] = s["step"] in replicated
        protected = [e for e in events if e.get("event") == "protected"]
        pairing = [e for e in events if e.get("event") == "pairing"]
        run, live = claim_holder(store.paths)
        entry: dict[str, Any] = {"job": job, "dir": store.job_dir, "steps": steps,
                                 "run": None if run is None else {**run.to_json(), "live": live},
                                 "usage_bytes": store.capacity.usage_bytes(),
                                 "protection": protected[-1] if protected else None,
                                 "pairing": pairing[-1] if pairing else None}
        if args.persistent:
            entry["persistent_steps"] = PersistentStorage(args.persistent).steps()
        out.append(entry)
    if args.json:
        print(json.dumps(out, indent=1))
        return EXIT_OK
    if not out:
        print(f"no checkpoints under {args.local_dir}")
    for entry in out:
        print(f"job {entry['job']}  ({entry['dir']}, {_size(entry['usage_bytes'])} on this node)")
        rows = [[s["step"], s["state"], _size(s["checkpoint_bytes"]), _size(s["bytes_here"]),
                 ",".join(f"{r}(partial)" if r in s["partial_here"] else str(r)
                          for r in s["shards_here"]) or "-",
                 ",".join(map(str, s["missing_here"])) or "-", "yes" if s["metadata"] else "no",
                 "yes" if s["replicated_from_here"] else "-"] for s in entry["steps"]]
        print(_table(rows, ["step", "state", "checkpoint", "here", "shards here (ranks)",
                            "not here", "metadata", "pushed to partner"]))
        print(_protection_line(entry["protection"]))
        if entry["run"] is not None and (run := Claimant.from_json(entry["run"])) is not None:
            print(f"{'in use by' if entry['run']['live'] else 'last run'}: {run.describe()}")
        if entry["pairing"] is not None:
            print(_pairing_line(entry["pairing"]))
        if "persistent_steps" in entry:
            print(f"persistent steps in {args.persistent}: {entry['persistent_steps'] or 'none'}")
        print()
    return EXIT_OK


def _pairing_line(event: dict[str, Any]) -> str:
    """This node's partners and their failure domains, as its last start recorded them."""
    def named(node: int, domain: str) -> str:
        return f"node {node} ({domain})" if domain else f"node {node}"

    targets = ", ".join(named(n, d) for n, d in event.get("targets", [])) or "none"
    held = ", ".join(named(n, d) for n, d in event.get("sources", [])) or "none"
    partners = "partners" if len(event.get("targets", [])) > 1 else "partner"
    return (f"this node: {named(event.get('node', '?'), event.get('domain', ''))}; {partners}: "
            f"{targets} (its replicas); it keeps those of {held}")


def _protection_line(event: dict[str, Any] | None) -> str:
    """The newest protected step this node's history knows of (its replicator records one
    each time a replication round leaves its save on 1 + replicas nodes)."""
    if event is None:
        return "protected (every shard on 1 + replicas nodes): no step yet"
    ago = time.time() - float(event.get("time", time.time()))
    lag, age = event.get("lag_steps"), event.get("age_seconds")
    copies = event.get("copies", 2)
    behind = "? steps" if lag is None else plural(lag, "step")
    return (f"protected (every shard on {copies} nodes): step {event.get('step')}, known {ago:.0f} s "
            f"ago; then {behind} behind the newest save, saved "
            f"{'?' if age is None else f'{age:.1f}'} s before")


def cmd_verify(args) -> int:
    """Every checksum of the step's copies here, then the planner's verdict over this node's
    holdings with the copies that failed counted absent, as a resume counts them."""
    store = _store(args, args.job)
    steps = store.inventory.steps()
    step = args.step if args.step is not None else (max(steps) if steps else None)
    if step is None or step not in steps:
        print(f"step {step} not found for job {args.job}", file=sys.stderr)
        return EXIT_NOT_FOUND
    st = store.inventory.step_state(step)
    results: list[dict[str, Any]] = []
    verdict = EXIT_OK
    bad: list[CopyId] = []  # copies here that fail: absent to the verdict
    locations: list[ItemLocation] = []  # the checksums a resume checks the bytes against
    try:
        locations = item_locations(store.metadata.read(step)[1])
        results.append({"item": "metadata", "status": "ok"})
    except CorruptShardError as e:
        results.append({"item": "metadata", "status": "corrupt", "error": str(e)})
        bad.append(CopyId(step, None, HERE))
    except ShardNotFoundError:
        results.append({"item": "metadata", "status": "not on this node"})
    shards: dict[int, dict[str, Any]] = {}
    for rank in sorted(st.committed_ranks):
        try:
            m = store.verify_shard(step, rank, [loc for loc in locations if loc.rank == rank])
            shards[rank] = {"item": f"rank {rank}", "status": "ok", "bytes": m.held_bytes,
                            "items": len(m.items), **({"partial": True} if m.partial else {})}
        except (CorruptShardError, ShardNotFoundError) as e:
            shards[rank] = {"item": f"rank {rank}", "status": "corrupt", "error": str(e)}
            bad.append(CopyId(step, rank, HERE))
    for rank, why in st.damaged.items():  # unreadable manifest, data missing or short
        shards[rank] = {"item": f"rank {rank}", "status": "corrupt", "error": why}
    found = verdicts_here(store, bad).get(step, StepVerdict(False))
    held = set(found.required or ()) - set(found.missing)  # every item here, some as copies
    for rank in sorted(set(st.required_ranks or ()) - set(shards)):
        shards[rank] = ({"item": f"rank {rank}", "status": "ok", "detail": "no shard here: its "
                         "items are data-parallel copies in the shards here"} if rank in held
                        else {"item": f"rank {rank}", "status": "not on this node"})
    for rank, r in shards.items():
        if r.get("partial"):
            r["detail"] = ("partial replica: some of the rank's items are not here"
                           if rank in found.missing else "partial replica")
    results += [shards[r] for r in sorted(shards)]
    if any(r["status"] == "corrupt" for r in results):
        verdict = EXIT_CORRUPT
    elif not found.complete:
        verdict = EXIT_INCOMPLETE
    if args.json:
        print(json.dumps({"job": args.job, "step": step, "verdict": VERDICTS[verdict],
                          "exit_status": verdict, "missing": list(found.missing),
                          "reason": found.reason, "results": results}, indent=1))
    else:
        print(_table([[r["item"], r["status"], _size(r.get("bytes")), r.get("error", r.get("detail", ""))]
                      for r in results], ["shard", "status", "bytes", "detail"]))
        print(f"step {step}: " + {EXIT_OK: "OK", EXIT_INCOMPLETE: "INCOMPLETE on this node",
                                  EXIT_CORRUPT: "CORRUPT"}[verdict]
              + (f" ({_not_here(found)})" if verdict == EXIT_INCOMPLETE else ""))
    return verdict


def _not_here(found: StepVerdict) -> str:
    """Why a step is not restorable from this node alone, in this node's words."""
    if found.foreign:
        return "another run of this job saved it: a resume sets it aside"
    if found.missing:
        ranks = found.missing
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {','.join(map(str, ranks))}"
        return f"some items of {who} are not here"
    return "its metadata is not here"


def cmd_gc(args) -> int:
    """Each job's directory is cleared only while no live run holds it (``store/claim.py``:
    the run's claim, looked at as a run's own start does); meanwhile no run can take it. A
    job a live run holds is left as it is, named with that run, and the exit status says so
    (``EXIT_IN_USE``)."""
    report: list[dict[str, Any]] = []
    for job in _jobs(args.local_dir, args.job):
        store = _store(args, job)
        with unclaimed(store.paths) as live:
            if live is not None:
                report.append({"job": job, "refused": "in use by a live run", "dir": store.job_dir,
                               "run": None if live.holder is None else live.holder.to_json()})
            elif args.finished and finished(store.paths) is None:
                report.append({"job": job, "kept": "not finished: a restart may resume it"})
            elif args.remove or args.finished:
                store.destroy()
                report.append({"job": job, "removed": "all"})
            else:
                removed = store.gc(min_age_s=args.min_age)
                retired = [] if args.keep is None else _retire_beyond(store, args.keep)
                report.append({"job": job, "debris_removed": len(removed), "steps_retired": retired})
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        for r in report:
            if r.get("refused"):
                run = Claimant.from_json(r["run"]) if r["run"] is not None else None
                who = run.describe() if run is not None else "a run whose record cannot be read"
                print(f"job {r['job']}: not touched: {r['dir']} is in use by {who}; stop that "
                      "run first (a live run's files are never removed)", file=sys.stderr)
            elif r.get("removed"):
                print(f"job {r['job']}: removed")
            elif r.get("kept"):
                print(f"job {r['job']}: kept ({r['kept']})")
            else:
                print(f"job {r['job']}: removed {plural(r['debris_removed'], 'uncommitted file')}; "
                      f"retired steps {r['steps_retired'] or 'none'}")
    return EXIT_IN_USE if any(r.get("refused") for r in report) else EXIT_OK


def _retire_beyond(store: LocalStore, keep: int) -> list[int]:
    """``gc --keep``: every shard of every step older than the newest ``keep`` complete steps
    here goes, whichever rank owns it (own shards, replicas, ranks of an earlier world size),
    with its metadata; returns those steps.

    What one node can know of "complete" is its own part: the step's metadata (written once
    every rank of the job committed its shard) and this node's shards of that same save
    (``retention.finished_steps``). A step being written has no metadata yet, so it and every
    newer one stay. So do the newest step held whole here and the newest protected step the
    node's history records (the whole-step and protection invariants). Retired buffers are
    freed, not pooled, and the pool of recycled buffers is emptied: a job still running makes
    new ones at its next saves."""
    protected = [e.get("step") for e in history.read(store.job_dir) if e.get("event") == "protected"]
    newest = protected[-1] if protected and isinstance(protected[-1], int) else None
    return apply_retention(store, (), keep, () if newest is None else (newest,), node_owners=())


def cmd_history(args) -> int:
    store = _store(args, args.job)
    events = history.read(store.job_dir)[-args.last:] if args.last else history.read(store.job_dir)
    if args.json:
        print(json.dumps(events, indent=1))
        return EXIT_OK
    rows = [[time.strftime("%H:%M:%S", time.localtime(e["time"])), e.get("event"), e.get("step"),
             e.get("rank"), _size(e.get("bytes")), f"{e['seconds']:.4f}" if e.get("seconds") is not None else "-",
             e.get("gbps", "-"), e.get("source") or e.get("transport") or ""] for e in events]
    print(_table(rows, ["time", "event", "step", "rank", "bytes", "seconds", "GB/s", "source/transport"]))
    return EXIT_OK


BENCHMARKS = ("local", "replication", "recovery")


def cmd_bench(args, extra: list[str], parser: argparse.ArgumentParser) -> int:
    if args.which is None:  # "bench" or "bench --help": which benchmarks there are
        parser.print_help()
        return EXIT_OK if args.bench_help else EXIT_NOT_FOUND
    if args.bench_help:
        extra = ["--help", *extra]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "benchmarks", f"bench_{args.which}.py")
    if not os.path.exists(script):
        print(f"benchmark {script} not found (benchmarks ship with the source tree)", file=sys.stderr)
        return EXIT_NOT_FOUND
    return subprocess.call([sys.executable, script, *extra])


def _at_least_one(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {n}")
    return n


LOCAL_DIR_HELP = "tmpfs root (default: $MLCHECKPOINT_LOCAL_DIR or /dev/shm/mlcheckpoint)"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mlcheckpoint", description="Inspect and manage in-memory checkpoints on this node.",
                                 epilog="'mlcheckpoint COMMAND --help' shows a command's own options "
                                 "(and, for verify, its exit statuses).")
    ap.add_argument("--local-dir", default=None, help=LOCAL_DIR_HELP)
    # The global options again for every command, so they may follow it too (``ls
    # --local-dir X``). SUPPRESS: not given after the command, the value before it stands.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--local-dir", default=argparse.SUPPRESS, help=LOCAL_DIR_HELP)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def command(name: str, **kw: Any) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], **kw)
    default_job = BY_NAME["job_id"].text()  # checked where it is used, like --job

    p = command("ls", help="steps per job: size, state, which shards are here")
    p.add_argument("--job", default=default_job)
    p.add_argument("--persistent", help="also list persistent steps in this directory/URL")
    p.add_argument("--json", action="store_true")

    p = command("verify", help="check every checksum of a step (exit status: see verify --help)",
                       description="Check every checksum of a step on this node against the "
                       "step's metadata, as a resume does.", epilog=EXIT_CODES_HELP)
    p.add_argument("--job", default=default_job, required=default_job is None)
    p.add_argument("--step", type=int, help="default: the newest step")
    p.add_argument("--json", action="store_true")

    p = command("gc", help="remove debris and old steps, or whole finished jobs; a job a live "
                "run holds is left as it is (exit status 4)",
                description="Remove what crashes left, old steps, or whole finished jobs. A job "
                "directory that a live run holds is never touched: gc names the run (host, "
                "pids) and exits with status 4; once that run has ended it proceeds.",
                epilog="exit status: 0 done, 2 job not found, 4 a live run holds a job (left as it is)")
    p.add_argument("--job", default=default_job, help="default: every job under --local-dir")
    p.add_argument("--keep", type=_at_least_one, help="also retire every shard (any rank's) of all but the newest "
                   "KEEP complete steps; a step still being written, the newest step held whole "
                   "here and the newest protected step stay")
    p.add_argument("--min-age", type=float, default=600.0,
                   help="spare uncommitted files younger than this many seconds (a save in flight)")
    p.add_argument("--remove", action="store_true",
                   help="delete the job's files entirely: for a finished job (its last run "
                   "closed cleanly and left finished.json; docs/operations.md); refused while "
                   "a live run holds it")
    p.add_argument("--finished", action="store_true",
                   help="delete entirely only the jobs whose last run closed cleanly "
                   "(finished.json; the first memory to reclaim); others are kept")
    p.add_argument("--json", action="store_true")

    p = command("history", help="every save, replication, persistent write and resume")
    p.add_argument("--job", default=default_job, required=default_job is None)
    p.add_argument("--last", type=int, default=0)
    p.add_argument("--json", action="store_true")

    # Its options are the benchmark script's own: everything after the name goes to it, --help
    # included (so "bench local --help" lists bench_local.py's options, not these).
    p = command("bench", add_help=False, help="run a benchmark (local | replication | recovery); "
                "'bench NAME --help' lists its options",
                usage="mlcheckpoint bench {local,replication,recovery} [the benchmark's options]",
                description="Run one of the benchmarks that ship with the source tree "
                "(benchmarks/bench_NAME.py). Every option after NAME goes to the benchmark: "
                "'mlcheckpoint bench local --help' lists them. --quick is a smoke run, whose "
                "ratios are information; the targets are judged in a full run on an idle machine.")
    p.add_argument("which", nargs="?", choices=BENCHMARKS, metavar="{local,replication,recovery}")
    p.add_argument("-h", "--help", action="store_true", dest="bench_help", help=argparse.SUPPRESS)
    return ap


def _subparser(ap: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in ap._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise KeyError(name)


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args, extra = ap.parse_known_args(argv)
    if extra and args.cmd != "bench":
        ap.error(f"unrecognized arguments: {' '.join(extra)}")
    args.local_dir = resolve_local_dir(args.local_dir)
    try:
        if args.cmd == "bench":
            return cmd_bench(args, extra, _subparser(ap, "bench"))
        code = {"ls": cmd_ls, "verify": cmd_verify, "gc": cmd_gc, "history": cmd_history}[args.cmd](args)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return code
    except BrokenPipeError:
        # The reader is gone (``| head``): stop quietly. Later flushes (at exit) must not
        # raise again, so stdout is pointed at /dev/null.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_CLOSED_PIPE
    except MLCheckpointError as e:
        print(f"mlcheckpoint: {e}", file=sys.stderr)
        return EXIT_NOT_FOUND


if __name__ == "__main__":
    sys.exit(main())

"""The mlcheckpoint command line on real checkpoints (run as a subprocess, as users run it)."""

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch
from helpers import begin, damage_shard, payload, put_save, put_shard, put_step

from mlcheckpoint import CheckpointManager, history
from mlcheckpoint._messages import plural
from mlcheckpoint.cli import (
    EXIT_CLOSED_PIPE,
    EXIT_CORRUPT,
    EXIT_INCOMPLETE,
    EXIT_NOT_FOUND,
    EXIT_OK,
    _protection_line,
    main,
)
from mlcheckpoint.manager.listing import list_checkpoints, step_label
from mlcheckpoint.recovery import NodeInventory, plan_resume
from mlcheckpoint.recovery.planner import MEMORY
from mlcheckpoint.store import LocalStore


@pytest.fixture
def job():
    root = tempfile.mkdtemp(prefix="mlckpt-cli-", dir="/dev/shm")
    try:
        with CheckpointManager(job_id="clijob", local_dir=root, replication="none", keep=3) as ckpt:
            for step in range(3):
                ckpt.save({"w": torch.arange(1000.0) + step, "meta": {"step": step}}, step)
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def cli(capsys):
    """Run the CLI in-process (torch is already imported) and capture its output."""
    def run(root, *args):
        code = main(["--local-dir", root, *args])
        captured = capsys.readouterr()
        return code, captured.out, captured.err
    return run


@pytest.mark.slow
def test_console_entry_point_runs_as_a_process(job):
    """`python -m mlcheckpoint.cli ls --json` runs as its own process and lists the job."""
    proc = subprocess.run([sys.executable, "-m", "mlcheckpoint.cli", "--local-dir", job, "ls", "--json"],
                          check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    assert json.loads(proc.stdout)[0]["job"] == "clijob"


def test_ls_lists_steps_and_shards(job, cli):
    code, out, _ = cli(job, "ls")
    assert code == 0
    assert "job clijob" in out and "complete" in out
    code, out, _ = cli(job, "ls", "--json")
    data = json.loads(out)
    assert [s["step"] for s in data[0]["steps"]] == [0, 1, 2]
    assert all(s["state"] == "complete" and s["shards_here"] == [0] and s["metadata"] for s in data[0]["steps"])


def test_ls_names_the_run_that_holds_the_directory(job, cli):
    code, out, _ = cli(job, "ls")
    assert code == 0 and "last run: run " in out and f"pid {os.getpid()}" in out
    with CheckpointManager(job_id="clijob", local_dir=job, replication="none", keep=3):
        code, out, _ = cli(job, "ls", "--json")
        run = json.loads(out)[0]["run"]
        assert run["live"] and run["pids"] == [os.getpid()]
        code, out, _ = cli(job, "ls")
        assert "in use by: run " in out
    assert not json.loads(cli(job, "ls", "--json")[1])[0]["run"]["live"]


def test_verify_exit_status_reflects_checksums(job, cli):
    code, out, _ = cli(job, "verify", "--job", "clijob", "--step", "2")
    assert code == 0 and "OK" in out
    store = LocalStore(job, "clijob", create=False)
    damage_shard(store, 1, 0, at=5)
    code, out, _ = cli(job, "verify", "--job", "clijob", "--step", "1", "--json")
    assert code == EXIT_CORRUPT == 3
    verdict = json.loads(out)
    assert verdict["verdict"] == "corrupt"
    assert any(r["status"] == "corrupt" and "checksum mismatch" in r["error"] for r in verdict["results"])
    code, _, _ = cli(job, "verify", "--job", "clijob", "--step", "0")
    assert code == 0  # other steps unaffected
    code, _, _ = cli(job, "verify", "--job", "clijob", "--step", "99")
    assert code == EXIT_NOT_FOUND == 2


def test_verify_reports_missing_shards(job, cli):
    store = LocalStore(job, "clijob", create=False)
    os.unlink(store.paths.manifest(2, 0))  # the shard is no longer committed here
    code, out, _ = cli(job, "verify", "--job", "clijob", "--step", "2")
    assert code == EXIT_INCOMPLETE == 1 and "INCOMPLETE" in out


def test_gc_removes_debris_and_old_steps(job, cli):
    store = LocalStore(job, "clijob", create=False)
    debris = store.paths.data(2, 5) + ".inflight"
    with open(debris, "wb") as f:
        f.write(b"x" * 100)
    code, _, _ = cli(job, "gc", "--job", "clijob", "--min-age", "0", "--keep", "1")
    assert code == 0
    assert not os.path.exists(debris)
    assert store.inventory.complete_steps() == [2]
    code, _, _ = cli(job, "gc", "--job", "clijob", "--remove")
    assert code == 0 and not os.path.exists(os.path.join(job, "clijob"))


@pytest.fixture
def resized():
    """Node 0 of a job that ran 2 x 2 (steps 1, 2: its ranks 0, 1 and the replicas of node 1's
    ranks 2, 3), then 1 x 2 (steps 3 to 5), and is writing step 6: rank 0's shard committed,
    rank 1's still being written, no metadata yet."""
    root = tempfile.mkdtemp(prefix="mlckpt-cli-", dir="/dev/shm")
    store = LocalStore(root, "gcjob")
    try:
        for step in (1, 2):
            put_step(store, step, ranks=(0, 1, 2, 3))
        for step in (3, 4, 5):
            put_step(store, step, ranks=(0, 1))
        put_shard(store, 6, 0)
        begin(store, 6, 1, payload(6, 1))
        yield root, store
    finally:
        store.close()
        shutil.rmtree(root, ignore_errors=True)


def held(store: LocalStore) -> dict[int, list[int]]:
    return {s: sorted(store.inventory.step_state(s).committed_ranks) for s in store.inventory.steps()}


def test_gc_keep_retires_every_ranks_shards_of_older_steps_never_the_step_being_written(resized, cli):
    """``gc --keep N`` keeps the N newest complete steps (metadata here, and this node's shards
    of that save) and whatever is newer; every other step goes whole, whoever owns its shards
    (ranks 2, 3 are no rank's of the 1 x 2 job), metadata included."""
    root, store = resized
    inflight = store.paths.data(6, 1) + ".inflight"
    code, out, _ = cli(root, "gc", "--job", "gcjob", "--keep", "2", "--json")
    assert code == 0 and json.loads(out)[0]["steps_retired"] == [1, 2, 3]
    assert held(store) == {4: [0, 1], 5: [0, 1], 6: [0]}
    assert os.path.exists(inflight)  # the shard being written, spared
    assert not os.path.exists(store.paths.step_dir(1)) and not os.path.exists(store.paths.step_dir(2))
    assert store.pool.owners() == set()  # what gc retires is freed, not pooled
    code, out, _ = cli(root, "gc", "--job", "gcjob", "--keep", "1")
    assert code == 0 and "retired steps [4]" in out, out
    assert held(store) == {5: [0, 1], 6: [0]} and os.path.exists(inflight)
    code, out, _ = cli(root, "gc", "--job", "gcjob", "--keep", "1")
    assert "retired steps none" in out, out


def test_gc_keep_spares_the_newest_protected_and_the_newest_whole_step(resized, cli):
    """The node's history names step 3 as the newest protected step: it stays, as the job's
    own retention would keep it until a newer one is protected. Step 5 lacks rank 1's shard
    here (a replica not back yet), so step 4 is the newest step held whole, and stays."""
    root, store = resized
    history.record(store.job_dir, "protected", step=3, lag_steps=2)
    store.shards.retire(5, 1)
    code, out, _ = cli(root, "gc", "--job", "gcjob", "--keep", "1", "--json")
    assert code == 0 and json.loads(out)[0]["steps_retired"] == [1, 2]
    assert held(store) == {3: [0, 1], 4: [0, 1], 5: [0], 6: [0]}


def test_gc_keep_must_keep_one(resized, capsys):
    root, store = resized
    with pytest.raises(SystemExit):
        main(["--local-dir", root, "gc", "--job", "gcjob", "--keep", "0"])
    assert "must be 1 or more" in capsys.readouterr().err
    assert held(store)[1] == [0, 1, 2, 3]


def test_history_records_saves_and_resume(job, cli):
    with CheckpointManager(job_id="clijob", local_dir=job, replication="none") as ckpt:
        sd = {"w": torch.zeros(1000), "meta": {"step": -1}}
        info = ckpt.resume(sd)
        assert info.step == 2 and torch.equal(sd["w"], torch.arange(1000.0) + 2)
    code, out, _ = cli(job, "history", "--job", "clijob", "--json")
    events = json.loads(out)
    assert [e["event"] for e in events].count("save") == 3
    resume = [e for e in events if e["event"] == "resume"][-1]
    assert resume["step"] == 2 and resume["source"] == "local"
    code, out, _ = cli(job, "history", "--job", "clijob")
    assert code == 0 and "resume" in out


def test_unknown_job_is_a_clear_error(job, cli):
    code, _, err = cli(job, "verify", "--job", "nosuchjob")
    assert code == 2 and "no job 'nosuchjob'" in err


def test_verify_checks_bytes_against_the_step_metadata(job, cli):
    """A flipped data byte whose manifest checksum was rewritten to match still fails: verify
    checks against the checksums the step's metadata recorded, as a resume does."""
    from mlcheckpoint.integrity.checksum import checksum
    from mlcheckpoint.store.manifest import Manifest

    store = LocalStore(job, "clijob", create=False)
    m = store.shards.read_manifest(2, 0)
    item = damage_shard(store, 2, 0, at=10)
    with open(store.paths.data(2, 0), "rb") as f:
        f.seek(item.offset)
        forged = checksum(f.read(item.nbytes))
    d = m.to_dict()
    next(i for i in d["items"] if i["key"] == item.key)["checksum"] = forged
    with open(store.paths.manifest(2, 0), "wb") as f:
        f.write(Manifest.from_dict(d).to_bytes())
    store.close()
    code, out, _ = cli(job, "verify", "--job", "clijob", "--step", "2")
    assert code == EXIT_CORRUPT and "CORRUPT" in out and "metadata item" in out, out


def test_verify_exit_status_is_the_worst_finding(job, cli):
    """Exit codes rise with severity (ok < incomplete < not found < corrupt), and a step with
    several findings exits with the worst: a corrupt shard beside missing metadata is corrupt."""
    assert EXIT_OK < EXIT_INCOMPLETE < EXIT_NOT_FOUND < EXIT_CORRUPT
    store = LocalStore(job, "clijob", create=False)
    os.unlink(store.paths.metadata(1))  # step 1: only the metadata is elsewhere
    code, out, _ = cli(job, "verify", "--job", "clijob", "--step", "1", "--json")
    assert code == EXIT_INCOMPLETE and json.loads(out)["verdict"] == "incomplete"
    os.unlink(store.paths.metadata(2))  # step 2: metadata elsewhere and a corrupt shard here
    damage_shard(store, 2, 0, at=3)
    store.close()
    code, out, _ = cli(job, "verify", "--job", "clijob", "--step", "2", "--json")
    assert code == EXIT_CORRUPT and json.loads(out)["verdict"] == "corrupt"
    assert cli(job, "verify", "--job", "clijob", "--step", "0")[0] == EXIT_OK


def test_verify_help_documents_the_exit_codes(capsys):
    with pytest.raises(SystemExit) as done:
        main(["verify", "--help"])
    assert done.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "0 ok, 1 incomplete on this node (the rest intact), 2 job or step not found, 3 corrupt" in out


@pytest.mark.slow
def test_bench_help_lists_the_benchmarks_own_options(capfd):
    """``mlcheckpoint bench local --help`` is the benchmark's help (its --quick and --shm-dir),
    not the wrapper's; ``bench --help`` names the benchmarks."""
    assert main(["bench", "local", "--help"]) == EXIT_OK
    out = capfd.readouterr().out
    assert "--quick" in out and "--shm-dir" in out and "--size-gb" in out, out
    assert main(["bench", "--help"]) == EXIT_OK
    out = capfd.readouterr().out
    assert "{local,replication,recovery}" in out and "--help' lists them" in " ".join(out.split()), out


def test_top_level_help_leaves_the_exit_codes_to_verify(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "3 corrupt" not in out and "by severity" not in out, out
    assert "'mlcheckpoint COMMAND --help' shows a command's own options" in out, out


# ---------------------------------------------------------------- issue 32: a Unix tool

def test_a_damaged_history_line_is_skipped_by_every_reader(job, cli):
    """``history.jsonl`` is appended by every rank of a node and outlives crashes: a line that
    is not an event as ``record`` writes it (cut, damaged, written by something else) is
    skipped, so ``ls``, ``history`` and ``retire`` still work. Before, a line "5" or a
    "replicate" event without its step raised in ``ls``, and a time that is no number in
    ``history``."""
    job_dir = os.path.join(job, "clijob")
    with open(os.path.join(job_dir, history.FILENAME), "a") as f:
        f.write('5\n[1, 2]\n{"time": 1.0, "event": "replicate"}\n{"time": "noon", "event": "save"}\n'
                '{"time": 1.0, "event": "replicate", "step": "3"}\n'
                '{"time": 1.0, "event": "save", "seconds": "fast"}\n{"time": 2.0, "event": 7}\n')
    history.record(job_dir, "save", step=9, rank=0, bytes=10, seconds=0.5)
    with open(os.path.join(job_dir, history.FILENAME), "ab") as f:
        f.write(bytes([0xA7, 0xFB]) + b'{"time": 2.5, "event": "save"}\n')  # bytes that are no UTF-8
        f.write(b'{"time": 3.0, "eve')  # a last line cut short
    events = history.read(job_dir)
    assert events and all(isinstance(e, dict) and isinstance(e["event"], str) for e in events)
    assert [e["step"] for e in events if e["event"] == "save"][-1] == 9
    assert not any(e.get("step") == "3" or e.get("seconds") == "fast" for e in events)
    for args in (["ls"], ["ls", "--json"], ["history", "--job", "clijob"],
                 ["history", "--job", "clijob", "--json"]):
        code, _, err = cli(job, *args)
        assert code == EXIT_OK and "Traceback" not in err, (args, err)
    assert "9" in cli(job, "history", "--job", "clijob")[1]


def test_global_options_may_follow_the_command(job, capsys):
    """``mlcheckpoint ls --local-dir X`` works as ``mlcheckpoint --local-dir X ls`` does."""
    for argv in (["ls", "--local-dir", job, "--json"], ["--local-dir", job, "ls", "--json"],
                 ["--local-dir", "/nonexistent", "ls", "--local-dir", job, "--json"]):
        assert main(argv) == EXIT_OK
        assert [s["step"] for s in json.loads(capsys.readouterr().out)[0]["steps"]] == [0, 1, 2]
    assert main(["verify", "--job", "clijob", "--local-dir", job]) == EXIT_OK
    assert main(["history", "--job", "clijob", "--local-dir", job, "--last", "1"]) == EXIT_OK


@pytest.mark.slow
def test_a_closed_pipe_ends_quietly(job):
    """``mlcheckpoint history | head -1``: the reader leaves after one line; the command stops
    without a traceback and with the status a shell gives a tool that SIGPIPE ended."""
    store = LocalStore(job, "clijob", create=False)
    for i in range(5000):  # far more than a pipe's buffer
        history.record(store.job_dir, "save", step=i, rank=0, bytes=1000, seconds=0.001)
    store.close()
    cli = subprocess.Popen([sys.executable, "-m", "mlcheckpoint.cli", "history", "--job", "clijob",
                            "--local-dir", job], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    head = subprocess.Popen(["head", "-1"], stdin=cli.stdout, stdout=subprocess.PIPE)
    assert cli.stdout is not None and cli.stderr is not None
    cli.stdout.close()  # head holds the only reading end now
    try:
        first, _ = head.communicate(timeout=120)
        err = cli.stderr.read().decode()
        code = cli.wait(timeout=120)
    finally:
        for p in (cli, head):
            p.kill()
            p.wait()
        cli.stderr.close()
    assert first.decode().split() == ["time", "event", "step", "rank", "bytes", "seconds", "GB/s",
                                      "source/transport"]
    assert err == "" and code == EXIT_CLOSED_PIPE == 141


def test_counted_words_are_singular_for_one(job, cli):
    assert plural(1, "step") == "1 step" and plural(2, "step") == "2 steps"
    assert plural(0, "copy", "copies") == "0 copies"
    line = _protection_line({"step": 5, "time": 0, "lag_steps": 1, "age_seconds": 0.5, "copies": 2})
    assert "then 1 step behind" in line
    assert "then 3 steps behind" in _protection_line({"step": 5, "time": 0, "lag_steps": 3})
    store = LocalStore(job, "clijob", create=False)
    with open(store.paths.data(2, 5) + ".inflight", "wb") as f:
        f.write(b"x")
    store.close()
    code, out, _ = cli(job, "gc", "--job", "clijob", "--min-age", "0")
    assert code == 0 and "removed 1 uncommitted file;" in out, out


def test_ls_names_steps_a_newer_whole_step_left_behind(job, cli):
    """Only a step with nothing whole after it is "incomplete": an older partial one is
    "superseded" (never pushed from here: replication went to a newer save) or "partly
    retired" (pushed, then retention took part of it)."""
    store = LocalStore(job, "clijob", create=False)
    os.unlink(store.paths.manifest(0, 0))
    os.unlink(store.paths.manifest(1, 0))
    history.record(store.job_dir, "replicate", step=0, rank=0, bytes=1, seconds=1.0)
    store.close()
    _, out, _ = cli(job, "ls", "--job", "clijob", "--json")
    states = {s["step"]: s["state"] for s in json.loads(out)[0]["steps"]}
    assert states == {0: "partly retired", 1: "superseded", 2: "complete"}
    store = LocalStore(job, "clijob", create=False)
    os.unlink(store.paths.manifest(2, 0))  # nothing whole any more: 2 is what a crash left
    store.close()
    _, out, _ = cli(job, "ls", "--job", "clijob", "--json")
    assert {s["step"]: s["state"] for s in json.loads(out)[0]["steps"]}[2] == "incomplete"
    assert step_label(complete=False, newer_complete=True, replicated=False) == "superseded"


@pytest.mark.slow
def test_ls_after_a_job_closed_agrees_with_protection():
    """After a clean finish, ``ls`` on each node names the newest protected step that
    ``ckpt.protection()`` gave (history recorded it although no later round closed the last
    one), and shows no step as "incomplete": what replication skipped is "superseded"."""
    from cluster import Cluster

    with Cluster(nnodes=2, nproc=1, job_id="endjob") as c:
        c.run("end_of_job.py", "8", timeout=240)
        seen = c.results("end_of_job")
        assert all(r["replicated"] for r in seen.values()), seen
        assert {r["newest_protected"] for r in seen.values()} == {7}
        for k in range(2):
            proc = subprocess.run([sys.executable, "-m", "mlcheckpoint.cli", "ls", "--local-dir",
                                   c.node(k).local_dir, "--json"],
                                  check=True, capture_output=True, text=True, timeout=120)
            (entry,) = json.loads(proc.stdout)
            assert entry["protection"]["step"] == 7, (k, entry["protection"])
            states = {s["step"]: s["state"] for s in entry["steps"]}
            assert states[7] == "complete" and "incomplete" not in states.values(), (k, states)


def test_gc_finished_removes_only_jobs_whose_last_run_closed_cleanly(cli):
    """``gc --finished`` reclaims a finished job's memory (its run closed cleanly and left
    finished.json) and keeps a job a restart may still resume (its run never closed)."""
    root = tempfile.mkdtemp(prefix="mlckpt-cli-", dir="/dev/shm")
    try:
        with CheckpointManager(job_id="done", local_dir=root, replication="none") as ckpt:
            ckpt.save({"w": torch.ones(10)}, 1)
        crashed = CheckpointManager(job_id="crashed", local_dir=root, replication="none")
        crashed.save({"w": torch.ones(10)}, 1)
        crashed.close(failed=True)  # as a crash leaves it: no finished mark
        code, out, _ = cli(root, "gc", "--finished")
        assert code == 0
        assert "job done: removed" in out and "job crashed: kept" in out
        assert not os.path.exists(os.path.join(root, "done"))
        assert LocalStore(root, "crashed", create=False).inventory.complete_steps() == [1]
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ------------------------------------------------------------- ls and verify: the planner's verdict
# Layouts one save (or a few) leaves on the nodes of a job, written straight into their stores
# (``put_save``: shards, data-parallel copies, partial replicas, metadata), keyed by name:
# (nodes, build(stores)).
def _newer_step_cut_short(stores):
    put_save(stores, 3, {0: ["a"], 1: ["b"]}, [{0: None, 1: None}, {1: None, 0: None}])
    put_save(stores, 4, {0: ["a"], 1: ["b"]}, [{0: None}, {1: None, 0: None}], save_id="save-4",
             metadata_on=[1])  # node 0: step 4 has no metadata, nor rank 1's shard


def _another_runs_step(stores):
    put_save(stores, 5, {0: ["a"], 1: ["b"]}, [{0: None, 1: None}], run_id="run-1", save_id="s5")
    put_save(stores, 3, {0: ["a"], 1: ["b"]}, [{0: None, 1: None}], run_id="run-2", save_id="s3")


LAYOUTS = {
    # node 1 holds only its own shard: rank 0's items are on node 0 alone
    "whole shards": (2, lambda st: put_save(st, 3, {0: ["a0"], 1: ["a1"]}, [{0: None, 1: None}, {1: None}])),
    # node 0: rank 1 whole, a partial replica of rank 0 without its item "b"
    "partial replica lacking items": (2, lambda st: put_save(
        st, 3, {0: ["a", "b"], 1: ["c"]}, [{0: ["a"], 1: None}, {0: None, 1: None}])),
    # DDP: every item of rank 1 is a copy in rank 0's shard; node 1 lacks rank 0's own item
    "data-parallel copies": (2, lambda st: put_save(
        st, 3, {0: ["model", "own0"], 1: ["model"]}, [{0: None}, {1: None}], primary={"model": 1})),
    # DDP with per-rank items: each node the other rank's per-rank items as a partial replica
    "copies and partial replicas": (2, lambda st: put_save(
        st, 3, {0: ["model", "own0"], 1: ["model", "own1"]},
        [{0: None, 1: ["own1"]}, {1: None, 0: ["own0"]}])),
    "metadata on another node": (2, lambda st: put_save(
        st, 3, {0: ["a"], 1: ["b"]}, [{0: None, 1: None}, {0: None, 1: None}], metadata_on=[1])),
    "a newer step cut short": (2, _newer_step_cut_short),
    "another run's newer step": (1, _another_runs_step),
}


@pytest.fixture
def laid_out(request):
    """The stores of ``LAYOUTS[request.param]``'s nodes, written; yields (root of each, stores)."""
    nodes, build = LAYOUTS[request.param]
    base = tempfile.mkdtemp(prefix="mlckpt-cli-", dir="/dev/shm")
    roots = [os.path.join(base, f"node{n}") for n in range(nodes)]
    stores = [LocalStore(root, "laid") for root in roots]
    try:
        build(stores)
        yield roots, stores
    finally:
        for s in stores:
            s.close()
        shutil.rmtree(base, ignore_errors=True)


def ls_steps(cli, root) -> dict[int, dict]:
    code, out, _ = cli(root, "ls", "--job", "laid", "--json")
    assert code == EXIT_OK
    return {s["step"]: s for s in json.loads(out)[0]["steps"]}


def planner_loads(store: LocalStore, step: int, world: int) -> bool:
    """Whether ``plan_resume`` over this node's inventory alone loads ``step`` when every newer
    step is ruled out (``bad_steps``): whether it counts the step complete."""
    inv = NodeInventory(0, [0], store.inventory.all())
    d = plan_resume([inv], None, world, bad_steps=[s for s in inv.steps if s > step])
    return (d.kind, d.step) == (MEMORY, step)


@pytest.mark.parametrize("laid_out", ["partial replica lacking items"], indirect=True)
def test_a_partial_replica_lacking_items_is_not_whole_here(laid_out, cli):
    """Node 0 holds rank 1's shard and a partial replica of rank 0's without one of its items:
    ls and verify say incomplete and name rank 0 (they counted the replica as whole: OK)."""
    (root, _), (store, _) = laid_out
    step = ls_steps(cli, root)[3]
    assert (step["state"], step["missing_here"], step["partial_here"]) == ("incomplete", [0], [0])
    assert step["shards_here"] == [0, 1] and step["bytes_here"] == 2 * 256  # the items it holds
    assert "0(partial),1" in cli(root, "ls", "--job", "laid")[1]
    code, out, _ = cli(root, "verify", "--job", "laid", "--json")
    report = json.loads(out)
    assert code == EXIT_INCOMPLETE and (report["verdict"], report["missing"]) == ("incomplete", [0])
    rank0 = next(r for r in report["results"] if r["item"] == "rank 0")
    assert rank0["status"] == "ok" and rank0["partial"] and "not here" in rank0["detail"]
    code, out, _ = cli(root, "verify", "--job", "laid")
    assert code == EXIT_INCOMPLETE and "INCOMPLETE on this node (some items of rank 0 are not here)" in out
    entry, = list_checkpoints(store, None, None)
    assert (entry.state, entry.ranks, entry.missing) == ("incomplete", [0, 1], [0])


@pytest.mark.parametrize("laid_out", ["data-parallel copies"], indirect=True)
def test_items_held_as_data_parallel_copies_count_as_here(laid_out, cli):
    """Node 0 holds rank 0's shard, which keeps a copy of every item of rank 1's: a resume
    loads the step from node 0 alone, and ls and verify say so (they said rank 1 was missing
    and verify exited 1)."""
    (root, other), (store, _) = laid_out
    step = ls_steps(cli, root)[3]
    assert (step["state"], step["shards_here"], step["missing_here"]) == ("complete", [0], [])
    assert planner_loads(store, 3, 2)
    code, out, _ = cli(root, "verify", "--job", "laid", "--json")
    report = json.loads(out)
    assert code == EXIT_OK and report["verdict"] == "ok", report
    rank1 = next(r for r in report["results"] if r["item"] == "rank 1")
    assert rank1["status"] == "ok" and "copies" in rank1["detail"]
    # node 1 (rank 1's shard: the copy of "model" only): rank 0's own item is missing there
    assert ls_steps(cli, other)[3]["missing_here"] == [0]
    assert cli(other, "verify", "--job", "laid")[0] == EXIT_INCOMPLETE


@pytest.mark.parametrize("laid_out", sorted(LAYOUTS), indirect=True)
def test_ls_and_verify_say_what_the_planner_decides(laid_out, cli):
    """On every node of every layout, a step is "complete" in ls (and OK for verify) exactly
    when ``plan_resume`` over that node's inventory counts it complete; "not here" names ranks
    only for a step that is not."""
    roots, stores = laid_out
    for root, store in zip(roots, stores, strict=True):
        for step, row in ls_steps(cli, root).items():
            loads = planner_loads(store, step, 2)
            assert (row["state"] == "complete") == loads, (root, step, row)
            assert not (loads and row["missing_here"]), (root, step, row)
            code, _, _ = cli(root, "verify", "--job", "laid", "--step", str(step))
            assert code == (EXIT_OK if loads else EXIT_INCOMPLETE), (root, step, code)


@pytest.mark.parametrize("laid_out", ["another run's newer step"], indirect=True)
def test_a_step_of_another_run_is_named_so(laid_out, cli):
    """Step 5 was saved by a run the newest save here (step 3, run-2) does not descend from: a
    resume never loads it, so ls does not call it complete (it did) but "other run"."""
    (root,), _ = laid_out
    states = {s: row["state"] for s, row in ls_steps(cli, root).items()}
    assert states == {3: "complete", 5: "other run"}
    code, out, _ = cli(root, "verify", "--job", "laid", "--step", "5")
    assert code == EXIT_INCOMPLETE and "another run" in out


@pytest.mark.parametrize("how", ["truncated", "deleted", "bad_manifest"])
@pytest.mark.parametrize("laid_out", ["whole shards"], indirect=True)
def test_verify_calls_a_damaged_shard_corrupt(laid_out, cli, how):
    """A shard here whose data is short or gone, or whose manifest is unreadable, is a copy a
    resume refuses: verify says corrupt (it said "not on this node", exit 1) and ls does not
    count it."""
    (root, _), (store, _) = laid_out
    damage_shard(store, 3, 1, how)
    code, out, _ = cli(root, "verify", "--job", "laid", "--json")
    report = json.loads(out)
    assert code == EXIT_CORRUPT, report
    assert next(r for r in report["results"] if r["item"] == "rank 1")["status"] == "corrupt"
    assert report["missing"] == [1]
    step = ls_steps(cli, root)[3]
    assert (step["state"], step["missing_here"]) == ("incomplete", [1])


@pytest.mark.parametrize("laid_out", ["data-parallel copies"], indirect=True)
def test_verify_counts_a_corrupt_copy_as_absent(laid_out, cli):
    """Node 0 holds rank 0's shard, which keeps the copy of rank 1's one item. With a byte of
    that copy flipped, rank 0's shard is refused whole, as a resume refuses it: neither rank's
    items are here any more."""
    (root, _), (store, _) = laid_out
    assert cli(root, "verify", "--job", "laid")[0] == EXIT_OK
    damage_shard(store, 3, 0, item="model")
    code, out, _ = cli(root, "verify", "--job", "laid", "--json")
    report = json.loads(out)
    assert code == EXIT_CORRUPT and report["missing"] == [0, 1], report
    assert [r["status"] for r in report["results"]] == ["ok", "corrupt", "not on this node"]

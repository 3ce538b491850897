"""Crash safety with real processes and real SIGKILLs (1 simulated node x 2 ranks).

A rank killed at each stage of a save must leave nothing that looks committed, a restart must
resume from the previous complete step with its exact state, and gc must clear the debris.
Corrupt or truncated shards must be refused at resume in favour of an older good step.
"""

from __future__ import annotations

import os
import re
import shutil

import pytest
from cluster import Cluster, lose_node
from helpers import flip_shard_byte, wait_for

from mlcheckpoint import LocalStore
from mlcheckpoint.store import layout
from mlcheckpoint.store.manifest import Manifest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NPROC = 2
LAUNCH_TIMEOUT = 120


# (crash point, rank that dies, save mode used): every point, over the several save paths.
CRASHES = [
    ("before_data", 1, "sync"),
    ("mid_data", 1, "async"),
    ("before_manifest", 1, "dcp"),
    ("mid_commit", 1, "dcp_async"),
    ("before_metadata", 0, "async"),
]


# ---------------------------------------------------------------------------- helpers
def open_store(local_dir: str, job_id: str) -> LocalStore:
    return LocalStore(local_dir, job_id, create=False)


def step_files(store: LocalStore, step: int) -> set[str]:
    try:
        return set(os.listdir(store.step_dir(step)))
    except FileNotFoundError:
        return set()


def debris(store: LocalStore) -> list[str]:
    """Uncommitted leftovers in any step: in-flight files and data without a manifest."""
    out = []
    for step in store.steps():
        names = step_files(store, step)
        committed = {layout.parse_manifest_name(n) for n in names} - {None}
        for n in names:
            orphan = n.endswith(".data") and int(n[5:10]) not in committed
            if n.endswith((layout.PARTIAL, layout.TMP)) or orphan:
                out.append(f"{step}/{n}")
    return sorted(out)


def verify_complete(store: LocalStore) -> list[int]:
    """Verify every shard of every complete step (raises on a bad one); return the steps."""
    steps = store.complete_steps()
    for step in steps:
        header, _ = store.read_metadata(step)
        assert header.ranks == [0, 1], header
        for r in header.ranks:
            store.verify_shard(step, r)
    return steps


def check_resumed(results: dict[int, dict], step: int, source: str, logs: str = "") -> None:
    assert sorted(results) == list(range(NPROC)), f"ranks reporting: {sorted(results)}\n{logs}"
    for rank, r in results.items():
        assert (r["step"], r["source"]) == (step, source), (rank, r, logs)
        assert r["match"] and not r["mismatch"], (rank, r)


# ---------------------------------------------------------------------------- crash points
@pytest.fixture(scope="module")
def crash_runs():
    """One job per crash point on one node: each saves steps 0..2, then dies saving step 3.
    Then one restart (new processes) resumes every job. Yields per-point observations."""
    with Cluster(1, NPROC) as c:
        node = c.nodes[0]
        obs: dict[str, dict] = {}
        for point, rank, mode in CRASHES:
            job = f"{c.job_id}-{point}"
            log_start = len(node.log())
            c.start("multi_job.py", "0", "3", f"{job}:{mode}",
                    env={"MLCHECKPOINT_CRASH_AT": f"{point}@3#{rank}"})
            codes = c.wait(LAUNCH_TIMEOUT)
            o = obs[point] = {"job": job, "codes": codes, "log": node.log()[log_start:]}

            # What a new process finds, before anything cleaned up.
            store = open_store(node.local_dir, job)
            try:
                o["complete"] = store.complete_steps()
                o["verified"] = verify_complete(store)
                o["step3_files"] = step_files(store, 3)
                o["debris"] = debris(store)
            finally:
                store.close()

            # gc straight on a copy of the crashed state (no resume involved).
            copy_dir = os.path.join(c.root, "gc-copy")
            shutil.copytree(os.path.join(node.local_dir, job), os.path.join(copy_dir, job))
            store = open_store(copy_dir, job)
            try:
                o["gc_removed"] = store.gc()
                o["gc_debris"] = debris(store)
                o["gc_complete"] = verify_complete(store)
            finally:
                store.close()

        c.clear_results()
        log_start = len(node.log())
        c.run("multi_job.py", "4", "3", *(f"{obs[p]['job']}:sync" for p, _, _ in CRASHES),
              timeout=LAUNCH_TIMEOUT)
        restart_log = node.log()[log_start:]
        for point, o in obs.items():
            o["resume"] = c.results(f"resume-{o['job']}")
            o["restart_log"] = restart_log
            store = open_store(node.local_dir, o["job"])
            try:
                o["after_resume_debris"] = debris(store)  # resume's per-rank gc ran
                o["after_resume_complete"] = verify_complete(store)
                o["gc2_removed"] = store.gc()
                o["gc2_debris"] = debris(store)
                o["step3_files_final"] = step_files(store, 3)
            finally:
                store.close()

        # Training goes on after the restart: step 3 is saved again over what the crash left,
        # then step 4; one more restart must find step 4 intact (test_save_again_after_crash).
        specs = [f"{obs[p]['job']}:{mode}" for p, _, mode in CRASHES]
        c.clear_results()
        log_start = len(node.log())
        c.start("multi_job.py", "3", "4", *specs)
        obs["resave"] = {"codes": c.wait(LAUNCH_TIMEOUT), "log": node.log()[log_start:]}
        for p, _, _ in CRASHES:
            o = obs[p]
            store = open_store(node.local_dir, o["job"])
            try:
                o["resave_complete"] = verify_complete(store)
                o["resave_debris"] = debris(store)
            finally:
                store.close()
        c.clear_results()
        c.start("multi_job.py", "5", "4", *specs)
        obs["resave"]["resume_codes"] = c.wait(LAUNCH_TIMEOUT)
        for p, _, _ in CRASHES:
            obs[p]["resave_resume"] = c.results(f"resume-{obs[p]['job']}")
        yield obs


@pytest.mark.parametrize("point,rank,mode", CRASHES, ids=[p for p, _, _ in CRASHES])
def test_crash_point(crash_runs, point, rank, mode):
    o = crash_runs[point]
    # The rank really died of SIGKILL, and torchrun failed the job.
    assert o["codes"] and all(code != 0 for code in o["codes"]), (o["codes"], o["log"])
    assert re.search(r"exitcode\s*:\s*-9\b", o["log"]) and "SIGKILL" in o["log"], o["log"][-4000:]

    # Step 3 is not complete; step 2 is; every complete shard verifies.
    assert 3 not in o["complete"] and 2 in o["complete"], o
    assert o["verified"] == o["complete"]

    # The crash happened where it was asked to: what step 3 holds proves the stage reached.
    files = o["step3_files"]
    assert layout.METADATA not in files, files
    if point == "before_metadata":
        assert {"rank-00000.manifest", "rank-00001.manifest"} <= files, files
    elif point == "mid_commit":
        assert {"rank-00001.data", "rank-00001.manifest.tmp"} <= files, files
        assert "rank-00001.manifest" not in files, files
    else:  # before_data, mid_data, before_manifest
        assert "rank-00001.data.partial" in files, files
        assert "rank-00001.manifest" not in files and "rank-00001.manifest.tmp" not in files, files
    if point != "before_metadata":
        assert o["debris"], "the crash should have left uncommitted files"

    # gc alone (on a copy of the crashed state) removes the debris and keeps complete steps.
    assert o["gc_debris"] == [], o["gc_debris"]
    assert len(o["gc_removed"]) >= len(o["debris"]), (o["gc_removed"], o["debris"])
    assert o["gc_complete"] == o["complete"]

    # A restart resumes the previous complete step, exactly.
    check_resumed(o["resume"], 2, "local", o["restart_log"])
    # resume's own per-rank gc already cleared the debris; a further full gc finds none, and
    # nothing committed was lost.
    assert o["after_resume_debris"] == [], o["after_resume_debris"]
    assert o["gc2_debris"] == [], o["gc2_debris"]
    assert not [p for p in o["gc2_removed"] if "/000000000003/" in p], o["gc2_removed"]
    assert o["after_resume_complete"] == o["complete"]
    assert not {n for n in o["step3_files_final"] if n.endswith((layout.PARTIAL, layout.TMP))}


def test_save_again_after_crash(crash_runs):
    """After the restart from step 2, the job saves step 3 again (over whatever the crash
    left) and step 4; a further restart resumes step 4 exactly, for every crash point."""
    resave = crash_runs["resave"]
    assert resave["codes"] == [0], resave["log"]
    assert resave["resume_codes"] == [0]
    for point, _, _ in CRASHES:
        o = crash_runs[point]
        assert {3, 4} <= set(o["resave_complete"]) and max(o["resave_complete"]) == 4, \
            (point, o["resave_complete"])
        assert o["resave_debris"] == [], (point, o["resave_debris"])
        check_resumed(o["resave_resume"], 4, "local")


# ---------------------------------------------------------------------------- corruption
def shard_paths(local_dir: str, job: str, step: int, rank: int) -> tuple[str, Manifest]:
    store = open_store(local_dir, job)
    try:
        return store.data_path(step, rank), store.read_manifest(step, rank)
    finally:
        store.close()


def truncate(local_dir: str, job: str, step: int, rank: int) -> None:
    path, m = shard_paths(local_dir, job, step, rank)
    os.truncate(path, m.data_bytes // 2)


@pytest.fixture(scope="module")
def corruption_runs():
    """Two jobs saving steps 0..3 (memory keeps 2 and 3); their shards are then damaged and
    one restart resumes them both."""
    with Cluster(1, NPROC) as c:
        node = c.nodes[0]
        jobs = {k: f"{c.job_id}-{k}" for k in ("flip", "truncate")}
        c.run("multi_job.py", "0", "3", f"{jobs['flip']}:sync", f"{jobs['truncate']}:async",
              timeout=LAUNCH_TIMEOUT)
        for job in jobs.values():
            store = open_store(node.local_dir, job)
            try:
                steps = verify_complete(store)
                assert {2, 3} <= set(steps) and max(steps) == 3, steps
            finally:
                store.close()

        out = {"jobs": jobs}
        out["flipped"] = flip_shard_byte(node.local_dir, jobs["flip"], 3, 1)
        truncate(node.local_dir, jobs["truncate"], 3, 0)

        c.clear_results()
        log_start = len(node.log())
        c.run("multi_job.py", "4", "3", f"{jobs['flip']}:sync", f"{jobs['truncate']}:async",
              timeout=LAUNCH_TIMEOUT)
        out["log"] = node.log()[log_start:]
        for k, job in jobs.items():
            out[k] = c.results(f"resume-{job}")
        yield out


def warnings_for(log: str, job: str, step: int, problem: str) -> list[str]:
    """Warning lines about ``problem`` in ``step`` of ``job`` (the message names the file)."""
    return [line for line in log.splitlines()
            if "WARNING" in line and problem in line and f"/{job}/steps/{step:012d}/" in line]


@pytest.mark.parametrize("damage,problem", [("flip", "checksum mismatch"), ("truncate", "truncated")])
def test_damaged_shard_refused(corruption_runs, damage, problem):
    r = corruption_runs
    job = r["jobs"][damage]
    check_resumed(r[damage], 2, "local", r["log"])
    for res in r[damage].values():
        assert "step 3" in res["reason"] and problem in res["reason"], res["reason"]
    assert warnings_for(r["log"], job, 3, problem), r["log"]


# ---------------------------------------------------------------------------- node loss
def test_kill_node_during_async_save_loop():
    with Cluster(1, NPROC) as c:
        node = c.nodes[0]

        def newest() -> int:
            store = open_store(node.local_dir, c.job_id)
            try:
                return max(store.complete_steps(), default=-1)
            finally:
                store.close()

        c.start("multi_job.py", "0", "1000000", f"{c.job_id}:async")
        wait_for(lambda: newest() >= 12 or node.proc.poll() is not None,
                 "the save loop to commit a dozen steps", timeout=LAUNCH_TIMEOUT)
        assert node.proc.poll() is None, f"the save loop ended early:\n{c.logs()}"
        # The node dies: agent and both ranks frozen and SIGKILLed wherever they are in a save.
        killed = lose_node(node)
        assert len(killed) >= 1 + NPROC, killed

        store = open_store(node.local_dir, c.job_id)
        try:
            complete = verify_complete(store)
        finally:
            store.close()
        assert complete and complete[-1] >= 12, complete

        c.clear_results()
        c.run("multi_job.py", "1000001", "0", f"{c.job_id}:async", timeout=LAUNCH_TIMEOUT)
        check_resumed(c.results(f"resume-{c.job_id}"), complete[-1], "local", c.logs())
        store = open_store(node.local_dir, c.job_id)
        try:
            store.gc()
            assert debris(store) == []
            assert verify_complete(store) == complete
        finally:
            store.close()


# ---------------------------------------------------------------------------- resume, then save
@pytest.mark.parametrize("variant,resumed,saved", [("fresh", None, 1), ("resave", 2, 4)],
                         ids=["fresh", "resave"])
def test_async_save_right_after_resume(variant, resumed, saved):
    """A training loop saves as soon as resume returns, with no barrier in between.

    fresh: nothing to resume, steps 0 and 1 are saved at once. resave: the run resumes step 2
    while step 3 is left over from the failed run, and saves steps 3 and 4 at once. Either
    way every save must succeed and a further resume must find the newest step exactly.
    The ranks of a node finish resume and start saving concurrently: rank 0 is held right
    after resume's last collective until rank 1 has staged its first save into tmpfs, the
    order in which node-wide cleanup after that collective would delete rank 1's new files.
    """
    with Cluster(1, NPROC) as c:
        staged = os.path.join(c.out_dir, "staged")
        c.start("resume_resave.py", variant, env={"MLCHECKPOINT_PAUSE_AT": f"resume_agreed#0={staged}"})
        codes = c.wait(LAUNCH_TIMEOUT)
        errors = [line for line in c.nodes[0].log().splitlines()
                  if "dropped steps" in line or ("Error" in line and "No such file" in line)][:8]
        assert codes == [0], "\n".join(errors) + "\n" + c.logs()[-3000:]
        assert os.path.exists(staged)  # rank 1 saved while rank 0 was held
        res = c.results("resumed")
        assert sorted(res) == [0, 1], res
        for rank, r in res.items():
            first, second = r["first"], r["second"]
            assert first["step"] == resumed and first["match"], (rank, r)
            assert (second["step"], second["source"], second["match"]) == (saved, "local", True), (rank, r)

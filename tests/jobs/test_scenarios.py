"""The failure scenarios, one table each: what a job resumes after its memory is lost or bad,
and what is left after a process dies mid-save or mid-transfer.

Each table is one parametrized test; its rows name what is done and what must be resumed or
left. Rows that need real processes are marked slow; the job-level rows share launches (one
module fixture runs every row's job of one cluster shape, each job its own job id).

- persistent fallback (one process): memory gone, or nothing in it that verifies, or older
  than the persistent tier: the persistent step is loaded, exactly, and the reason says why;
- killed mid-transfer: the receiver, or a sender, over one stream or several: nothing is
  committed, no buffer is left once gc (or the live receiver) has run, and a full push of
  the same shard lands verified;
- killed during a save (1 node x 2 ranks, real SIGKILLs): at every crash point of the save
  path, and a whole node killed from outside in a save loop: nothing that looks committed is
  torn, gc clears the debris, and a restart resumes the newest complete step exactly;
- a damaged local copy (flipped, truncated, deleted, bad manifest): with a replica on the
  partner node, it is replaced and rebuilt from the replica; alone, the previous step is
  resumed.

Multi-node variants that share tests/recovery/test_recovery.py's launches stay there: the
persistent fallback of a 2-node job (both nodes wiped, persistent newer, 4 ranks resumed on 2
with shards missing), a node dying mid-save or a rank killed mid-fetch in a replicated job,
and a corrupt replica in 2 x 2 ranks.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from cluster import Cluster, lose_node
from helpers import SHARD_DAMAGES, WAIT, damage_shard, wait_for
from states import assert_same, make_state, zeros_like_state
from tcp_job import debris, make_shard

from mlcheckpoint import CheckpointManager, ShardNotFoundError, _faults
from mlcheckpoint.replication import ReplicationError
from mlcheckpoint.replication.core import sink
from mlcheckpoint.store import LocalStore, layout
from mlcheckpoint.testing import internals

JOB = "job-scenarios"
MiB = 1 << 20

# DCP warns that it assumes a single process when no process group is initialised.
pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
              pytest.mark.usefixtures("whole_replicas")]


# ============================================================================ persistent fallback
def _manager(local: str, persistent: str) -> CheckpointManager:
    return CheckpointManager(persistent, job_id=JOB, local_dir=local, replication="none", keep=3)


@dataclass(frozen=True)
class Fallback:
    """Steps saved to memory and to the persistent tier, then what happens to memory."""

    memory: tuple[int, ...]
    persistent: tuple[int, ...]
    damage: Callable[[CheckpointManager], None]
    resumed: tuple[int, str]  # (step, source)
    reason_names: tuple[str, ...] | None = ()  # each is in ResumeInfo.reason; None: no reason


FALLBACKS = {
    "memory_lost": Fallback(
        memory=(5,), persistent=(4,), damage=lambda ckpt: internals(ckpt).store.destroy(),
        resumed=(4, "persistent")),
    "all_memory_corrupt": Fallback(
        memory=(2,), persistent=(1,),  # step 1 is in memory too
        damage=lambda ckpt: (damage_shard(internals(ckpt).store, 2, 0, item=0, at=0),
                             damage_shard(internals(ckpt).store, 1, 0, "truncated")),
        resumed=(1, "persistent"),
        reason_names=("step 2", "checksum mismatch", "step 1", "truncated")),
    "persistent_newer": Fallback(
        memory=(3,), persistent=(6,), damage=lambda ckpt: internals(ckpt).store.shards.retire(6, 0),
        resumed=(6, "persistent"), reason_names=("persistent step 6",)),
    "memory_newer": Fallback(  # the contrast: intact memory at least as new wins
        memory=(5,), persistent=(4,), damage=lambda ckpt: None, resumed=(5, "local"),
        reason_names=None),
}


@pytest.mark.parametrize("case", list(FALLBACKS))
def test_persistent_fallback(store_dir, case):
    row = FALLBACKS[case]
    local, persistent = os.path.join(store_dir, "local"), os.path.join(store_dir, "persistent")
    with _manager(local, persistent) as ckpt:
        for step in sorted(row.memory + row.persistent):
            ckpt.save(make_state(step), step, persistent=step in row.persistent)
        row.damage(ckpt)
    with _manager(local, persistent) as ckpt:  # the restarted job
        out = zeros_like_state(make_state())
        info = ckpt.resume(out)
    step, source = row.resumed
    assert (info.step, info.source) == (step, source), info
    assert info.sources == {0: source}, info
    if row.reason_names is None:
        assert info.reason is None, info.reason
    else:
        for words in row.reason_names:
            assert words in (info.reason or ""), info.reason
    assert_same(make_state(step), out)


# ============================================================================ killed mid-transfer
@dataclass(frozen=True)
class Cut:
    """Which end of a replica push dies (SIGKILL at its own crash point, half way through,
    so the bytes it never sent cannot sit in socket buffers and complete the shard)."""

    dies: str  # "receiver" or "sender"
    streams: int


CUTS = {
    "receiver": Cut("receiver", 1),
    "receiver_striped": Cut("receiver", 4),
    "sender": Cut("sender", 1),
    "sender_striped": Cut("sender", 4),
}
CUT_STEP, CUT_BYTES = 7, 32 * MiB


def _push_to_a_dying_receiver(job, streams: int) -> LocalStore:
    """Rank 0 (here) pushes its shard to rank 1, a process that dies once half has landed.
    Returns rank 1's store, as the dead process left it."""
    sender = job.endpoint(0, streams=streams, min_stripe_bytes=MiB)
    make_shard(sender.store, CUT_STEP, 0, CUT_BYTES, seed=1)
    proc = job.spawn(1, "serve", env={"MLCHECKPOINT_CRASH_AT": f"replica_mid_recv@{CUT_STEP}#0"})
    job.status("1.ready", proc)
    with pytest.raises(ReplicationError):
        sender.push_shard(1, CUT_STEP, 0)
    assert proc.wait(timeout=WAIT) == -signal.SIGKILL, job.logs()
    rstore = LocalStore(job.node_dir(1), job.job_id, create=False)
    # the dead receiver could not drop its buffer: gc does, and removes nothing else
    left = debris(rstore)
    assert left, "expected the half-received buffer to be left behind"
    assert sorted(os.path.basename(x) for x in rstore.gc()) == sorted(left)
    # the sender is unharmed: its copy verifies, and a push to the dead peer fails, not hangs
    sender.store.verify_shard(CUT_STEP, 0)
    with pytest.raises(ReplicationError):
        sender.push_shard(1, CUT_STEP, 0)
    return rstore


def _push_from_a_dying_sender(job, streams: int, monkeypatch) -> LocalStore:
    """Rank 1, a process, pushes its shard to rank 0 (here) and dies half way; rank 0 holds
    the transfer at half way meanwhile, so it can be looked at while it is open. Then rank 2
    (here), which holds the same shard, pushes it in full. Returns rank 0's store."""
    owner = 1
    half_received, go_on = threading.Event(), threading.Event()
    real_crash_point = sink.crash_point

    def pause_at_half(name, s=None, r=None):  # receiver side: hold the transfer at half way
        if name == "replica_mid_recv" and (s, r) == (CUT_STEP, owner) and not half_received.is_set():
            half_received.set()
            go_on.wait(WAIT)
        real_crash_point(name, s, r)

    monkeypatch.setattr(sink, "crash_point", pause_at_half)
    receiver = job.endpoint(0)
    rstore = receiver.store
    proc = job.spawn(owner, "push", peer=0, step=CUT_STEP, nbytes=CUT_BYTES, seed=3, streams=streams,
                     min_stripe_bytes=MiB, env={"MLCHECKPOINT_CRASH_AT": f"replica_mid_send@{CUT_STEP}"})
    try:
        wait_for(half_received.is_set, "the receiver to get half the shard", diag=job.logs)
        assert os.path.exists(rstore.paths.data(CUT_STEP, owner) + layout.INFLIGHT)
        with pytest.raises(ShardNotFoundError):
            rstore.shards.read_manifest(CUT_STEP, owner)
        assert proc.wait(timeout=WAIT) == -signal.SIGKILL, job.logs()
    finally:
        go_on.set()
    # the receiver stays up and drops the cut transfer itself: gc finds nothing left
    wait_for(lambda: len(receiver.server.stripes) == 0 and debris(rstore) == [],
             "the receiver to drop the cut transfer's buffer", diag=job.logs)
    assert not os.path.exists(os.path.join(job.status_dir, f"{owner}.result"))  # sender never finished
    assert rstore.gc() == []
    with pytest.raises(ShardNotFoundError):
        rstore.shards.read_manifest(CUT_STEP, owner)
    # another rank holding the same shard pushes it in full, and it lands verified
    other = job.endpoint(2, streams=streams, min_stripe_bytes=MiB)
    m = make_shard(other.store, CUT_STEP, owner, CUT_BYTES, seed=3)
    assert other.push_shard(0, CUT_STEP, owner) == CUT_BYTES
    got = rstore.verify_shard(CUT_STEP, owner)
    assert [(i.offset, i.nbytes, i.checksum) for i in got.items] == \
        [(i.offset, i.nbytes, i.checksum) for i in m.items]
    with open(rstore.paths.data(CUT_STEP, owner), "rb") as a, \
            open(other.store.paths.data(CUT_STEP, owner), "rb") as b:
        assert a.read(CUT_BYTES) == b.read(CUT_BYTES)
    assert debris(rstore) == []
    return rstore


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CUTS))
def test_killed_mid_transfer(make_job, monkeypatch, case):
    """A receiver or sender killed mid-push (one stream or several) commits nothing, leaves no
    buffer once gc has run, and a full push of the same shard then lands."""
    row = CUTS[case]
    if row.dies == "receiver":
        rstore = _push_to_a_dying_receiver(make_job(world=2), row.streams)
        owner = 0
    else:
        rstore = _push_from_a_dying_sender(make_job(world=3), row.streams, monkeypatch)
        owner = 1
    # whatever is left of the cut step is never taken for a checkpoint
    st = rstore.inventory.step_state(CUT_STEP)
    if row.dies == "receiver":
        assert not st.committed_ranks
    else:
        assert st.committed_ranks == {owner}  # the full push that followed
    assert not st.has_metadata and rstore.inventory.complete_steps() == []


# ============================================================================ killed during a save
NPROC = 2  # ranks of the one-node jobs below
LAUNCH_TIMEOUT = 120

# (crash point, rank that dies, save mode used): every point, over the several save paths.
CRASHES = [
    ("before_data", 1, "sync"),
    ("mid_data", 1, "async"),
    ("before_manifest", 1, "dcp"),
    ("mid_commit", 1, "dcp_async"),
    ("before_metadata", 0, "async"),
]
NODE_LOST = "node_lost_in_a_save_loop"  # the row without a crash point: SIGKILL from outside


def open_store(local_dir: str, job_id: str) -> LocalStore:
    return LocalStore(local_dir, job_id, create=False)


def step_files(store: LocalStore, step: int) -> set[str]:
    try:
        return set(os.listdir(store.paths.step_dir(step)))
    except FileNotFoundError:
        return set()


def save_debris(store: LocalStore) -> list[str]:
    """Uncommitted leftovers in any step: in-flight files and data without a manifest."""
    out = []
    for step in store.inventory.steps():
        names = step_files(store, step)
        committed = {layout.parse_manifest_name(n) for n in names} - {None}
        for n in names:
            orphan = n.endswith(".data") and int(n[5:10]) not in committed
            if n.endswith((layout.INFLIGHT, layout.TMP)) or orphan:
                out.append(f"{step}/{n}")
    return sorted(out)


def verify_complete(store: LocalStore) -> list[int]:
    """Verify every shard of every complete step (raises on a bad one); return the steps."""
    steps = store.inventory.complete_steps()
    for step in steps:
        header, _ = store.metadata.read(step)
        assert header.ranks == [0, 1], header
        for r in header.ranks:
            store.verify_shard(step, r)
    return steps


def check_resumed(results: dict[int, dict], step: int, source: str, logs: str = "") -> None:
    assert sorted(results) == list(range(NPROC)), f"ranks reporting: {sorted(results)}\n{logs}"
    for rank, r in results.items():
        assert (r["step"], r["source"]) == (step, source), (rank, r, logs)
        assert r["match"] and not r["mismatch"], (rank, r)


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
                o["complete"] = store.inventory.complete_steps()
                o["verified"] = verify_complete(store)
                o["step3_files"] = step_files(store, 3)
                o["debris"] = save_debris(store)
            finally:
                store.close()

            # gc straight on a copy of the crashed state (no resume involved).
            copy_dir = os.path.join(c.root, "gc-copy")
            shutil.copytree(os.path.join(node.local_dir, job), os.path.join(copy_dir, job))
            store = open_store(copy_dir, job)
            try:
                o["gc_removed"] = store.gc()
                o["gc_debris"] = save_debris(store)
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
                o["after_resume_debris"] = save_debris(store)  # resume's per-rank gc ran
                o["after_resume_complete"] = verify_complete(store)
                o["gc2_removed"] = store.gc()
                o["gc2_debris"] = save_debris(store)
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
                o["resave_debris"] = save_debris(store)
            finally:
                store.close()
        c.clear_results()
        c.start("multi_job.py", "5", "4", *specs)
        obs["resave"]["resume_codes"] = c.wait(LAUNCH_TIMEOUT)
        for p, _, _ in CRASHES:
            obs[p]["resave_resume"] = c.results(f"resume-{obs[p]['job']}")
        yield obs


@pytest.fixture(scope="module")
def node_lost_run():
    """A job saving back to back (async) loses its node, agent and ranks frozen and SIGKILLed
    wherever they are in a save; then a restart resumes. Observations as in crash_runs."""
    with Cluster(1, NPROC) as c:
        node = c.nodes[0]
        o: dict = {}

        def newest() -> int:
            store = open_store(node.local_dir, c.job_id)
            try:
                return max(store.inventory.complete_steps(), default=-1)
            finally:
                store.close()

        c.start("multi_job.py", "0", "1000000", f"{c.job_id}:async")
        wait_for(lambda: newest() >= 12 or node.proc.poll() is not None,
                 "the save loop to commit a dozen steps", timeout=LAUNCH_TIMEOUT)
        assert node.proc.poll() is None, f"the save loop ended early:\n{c.logs()}"
        o["killed"] = lose_node(node)
        store = open_store(node.local_dir, c.job_id)
        try:
            o["complete"] = store.inventory.complete_steps()
            o["verified"] = verify_complete(store)
        finally:
            store.close()

        c.clear_results()
        log_start = len(node.log())
        c.run("multi_job.py", "1000001", "0", f"{c.job_id}:async", timeout=LAUNCH_TIMEOUT)
        o["resume"] = c.results(f"resume-{c.job_id}")
        o["restart_log"] = node.log()[log_start:]
        store = open_store(node.local_dir, c.job_id)
        try:
            store.gc()
            o["gc2_debris"] = save_debris(store)
            o["after_resume_complete"] = verify_complete(store)
        finally:
            store.close()
        yield o


KILLS = [p for p, _, _ in CRASHES] + [NODE_LOST]


@pytest.mark.slow
@pytest.mark.timeout(600)  # the launches of its rows' module fixture
@pytest.mark.parametrize("case", KILLS)
def test_killed_during_a_save(request, case):
    """Whatever stage a save is killed at, every step that looks complete verifies, the
    interrupted one does not look complete, gc clears the debris and keeps the complete steps,
    and a restart resumes the newest complete step exactly."""
    if case == NODE_LOST:
        o = request.getfixturevalue("node_lost_run")
        assert len(o["killed"]) >= 1 + NPROC, o["killed"]  # the agent and both ranks
        assert o["complete"] and o["complete"][-1] >= 12, o["complete"]
    else:
        o = request.getfixturevalue("crash_runs")[case]
        check_crash_point(o, case)
    assert o["verified"] == o["complete"]
    check_resumed(o["resume"], o["complete"][-1], "local", o["restart_log"])
    assert o["gc2_debris"] == [], o["gc2_debris"]
    assert o["after_resume_complete"] == o["complete"]


def check_crash_point(o: dict, point: str) -> None:
    """What a crash point leaves: the rank died of SIGKILL, step 3 is not complete (2 is), its
    files prove the stage reached, and gc alone (on a copy) clears them."""
    assert o["codes"] and all(code != 0 for code in o["codes"]), (o["codes"], o["log"])
    assert _faults.CRASH_MESSAGE % point in o["log"], o["log"][-4000:]  # and then SIGKILLed itself
    assert 3 not in o["complete"] and o["complete"][-1] == 2, o

    files = o["step3_files"]
    assert layout.METADATA not in files, files
    if point == "before_metadata":
        assert {"rank-00000.manifest", "rank-00001.manifest"} <= files, files
    elif point == "mid_commit":
        assert {"rank-00001.data", "rank-00001.manifest.tmp"} <= files, files
        assert "rank-00001.manifest" not in files, files
    else:  # before_data, mid_data, before_manifest
        assert "rank-00001.data.inflight" in files, files
        assert "rank-00001.manifest" not in files and "rank-00001.manifest.tmp" not in files, files
    if point != "before_metadata":
        assert o["debris"], "the crash should have left uncommitted files"

    # gc alone (on a copy of the crashed state) removes the debris and keeps complete steps.
    assert o["gc_debris"] == [], o["gc_debris"]
    assert len(o["gc_removed"]) >= len(o["debris"]), (o["gc_removed"], o["debris"])
    assert o["gc_complete"] == o["complete"]
    # resume's own per-rank gc already cleared the debris, and nothing committed was lost
    assert o["after_resume_debris"] == [], o["after_resume_debris"]
    assert not [p for p in o["gc2_removed"] if "/000000000003/" in p], o["gc2_removed"]
    assert not {n for n in o["step3_files_final"] if n.endswith((layout.INFLIGHT, layout.TMP))}


@pytest.mark.slow
@pytest.mark.timeout(600)  # the launches of its rows' module fixture
def test_saves_again_after_a_kill_during_a_save(crash_runs):
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


# ============================================================================ a damaged local copy
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
        with contextlib.closing(open_store(node.local_dir, jobs["flip"])) as store:
            out["flipped"] = damage_shard(store, 3, 1).key
        with contextlib.closing(open_store(node.local_dir, jobs["truncate"])) as store:
            damage_shard(store, 3, 0, "truncated")

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


@pytest.fixture(scope="module")
def replicated_runs():
    """One job per damage on 2 nodes x 1 rank (tests/workers/rec_jobs.py): steps 2 and 3 are
    saved and replicated; node 0's own shard of step 3 is damaged; one restart resumes every
    job and waits until the resumed step is protected again."""
    with Cluster(2) as c:
        def launch(table: dict) -> None:
            c.clear_results()
            c.run("rec_jobs.py", json.dumps([dict(spec, job=c.sub_job(name)) for name, spec in table.items()]),
                  timeout=150)

        launch({name: {"first": 2, "last": 3} for name in SHARD_DAMAGES})
        for name in SHARD_DAMAGES:  # node 0's own shard (rank 0) of step 3
            with contextlib.closing(c.sub_job_store(0, name)) as store:
                damage_shard(store, 3, 0, name)
        launch({name: {"heal": True} for name in SHARD_DAMAGES})
        out: dict = {}
        for name in SHARD_DAMAGES:
            store = c.sub_job_store(0, name)
            try:
                rebuilt = store.verify_shard(3, 0).step  # node 0's own copy, healed
            finally:
                store.close()
            out[name] = {"resume": c.sub_job_results("resume", name),
                         "healed": c.sub_job_results("healed", name), "rebuilt": rebuilt}
        yield out


@dataclass(frozen=True)
class Damage:
    """A damaged local copy: with a replica on the partner node, or on a node alone."""

    how: str  # one of SHARD_DAMAGES
    launch: str  # the fixture that ran it
    resumed: tuple[int, str]  # (step, rank 0's source)
    reason_names: tuple[str, ...]


DAMAGED = {
    **{f"{how}_with_a_replica": Damage(how, "replicated_runs", (3, "peer"), ("step 3",)) for how in SHARD_DAMAGES},
    "flipped_alone": Damage("flipped", "corruption_runs", (2, "local"), ("step 3", "checksum mismatch")),
    "truncated_alone": Damage("truncated", "corruption_runs", (2, "local"), ("step 3", "truncated")),
}


@pytest.mark.slow
@pytest.mark.timeout(600)  # the launches of its rows' module fixture
@pytest.mark.parametrize("case", list(DAMAGED))
def test_damaged_local_copy(request, case):
    """A damaged local copy is never loaded: the replica replaces it (and the node's copy is
    rebuilt from it), or with no other copy the previous step is resumed, exactly."""
    row = DAMAGED[case]
    step, source = row.resumed
    how = row.how
    if row.launch == "replicated_runs":
        o = request.getfixturevalue("replicated_runs")[how]
        res = o["resume"]
        assert sorted(res) == [0, 1], res
        for rank, r in res.items():
            assert r["step"] == step and r["match"] and not r["mismatch"], (rank, r)
            assert {int(k): v for k, v in r["sources"].items()} == {0: source, 1: "local"}, r
        assert res[0]["bytes_fetched"] > 0, res
        assert all(h["protected"] for h in o["healed"].values()), o["healed"]
        assert o["rebuilt"] == 3  # node 0's own copy was rebuilt from the replica and verifies
        reasons = [r["reason"] for r in res.values()]
        if how == "flipped":
            assert all("checksum mismatch" in (x or "") for x in reasons), reasons
    else:
        runs = request.getfixturevalue("corruption_runs")
        damage = {"flipped": "flip", "truncated": "truncate"}[how]
        res = runs[damage]
        check_resumed(res, step, source, runs["log"])
        reasons = [r["reason"] for r in res.values()]
        # the warning names the damaged file
        problem = row.reason_names[-1]
        assert warnings_for(runs["log"], runs["jobs"][damage], 3, problem), runs["log"]
    for reason in reasons:
        for words in row.reason_names:
            assert words in (reason or ""), reason

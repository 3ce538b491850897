"""Generic fixtures shared by the test modules (keep this file small)."""

from __future__ import annotations

import atexit
import json
import logging
import multiprocessing.process
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
from tcp_job import TCP_LOGGER, Job

from mlcheckpoint.store import LocalStore
from mlcheckpoint.testing import forkserver
from mlcheckpoint.testing.cluster import LAUNCH_ENV

# Settings read from the environment; tests that depend on their absence use ``clean_env``.
MLCHECKPOINT_ENV_VARS = ("MLCHECKPOINT_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID",
                         "MLCHECKPOINT_LOCAL_DIR", "MLCHECKPOINT_CRASH_AT",
                         "MLCHECKPOINT_PAUSE_AT", "MLCHECKPOINT_PERSISTENT_DIR_MOVED")


# Files the suite's processes leave in the temporary directory go with the session: torch's
# multiprocessing (torchrun's ranks) writes a pytorch-errorfile-*.pickle for every rank that
# raises, as the suite's killed and failing jobs do, and never removes it (CI left hundreds in
# /tmp). Every process the suite starts inherits this TMPDIR; an exit handler registered this
# early runs after the ones that stop the fork server and clusters.
SESSION_TMP = tempfile.mkdtemp(prefix="mlckpt-tests-")
os.environ["TMPDIR"] = SESSION_TMP
tempfile.tempdir = None  # read again from TMPDIR


def _remove_session_tmp(owner: int = os.getpid()) -> None:
    if os.getpid() == owner:  # not in a child forked from this process
        shutil.rmtree(SESSION_TMP, ignore_errors=True)


atexit.register(_remove_session_tmp)


# Every Python process the suite launches imports tests/startup/sitecustomize.py first (the
# cyclic collector's thresholds while it imports torch; that file says why).
STARTUP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "startup")
if STARTUP_DIR not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (STARTUP_DIR, os.environ.get("PYTHONPATH")) if p)


# Simulated nodes are forked from a server that imported torch, DCP and mlcheckpoint once, and
# their ranks from their agent (mlcheckpoint/testing/cluster.py, LAUNCH_ENV): a node then costs
# a fraction of a CPU-second to start instead of 3.5. A test about torchrun as users type it
# (exec'd agents and ranks) passes ``launch="exec"`` to its cluster.
os.environ.setdefault(LAUNCH_ENV, "fork")


def _starts_python(args) -> bool:
    """Whether a Popen command line runs Python (a worker, torchrun, ``ip netns exec python``)."""
    argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
    return any(str(a) == sys.executable or os.path.basename(str(a)).startswith(("python", "torchrun"))
               for a in argv)


@pytest.fixture(autouse=True)
def fast_tests_start_no_processes(request, monkeypatch):
    """Keeps the fast tier (``-m "not slow"``) fast: a test not marked ``slow`` that starts a
    Python process fails, saying so. (Other commands, e.g. ``mount``, are allowed.)"""
    if request.node.get_closest_marker("slow") is not None:
        return
    popen_init = subprocess.Popen.__init__

    def refuse(what: str) -> None:
        pytest.fail(f"{request.node.nodeid} starts {what}: mark it @pytest.mark.slow", pytrace=False)

    def guarded_popen_init(self, args, *a, **kw):
        if _starts_python(args):
            self._child_created = False  # what Popen.__del__ reads
            refuse(f"a Python process ({args!r:.120})")
        popen_init(self, args, *a, **kw)

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded_popen_init)
    monkeypatch.setattr(forkserver.ForkServer, "spawn",
                        lambda self, argv, **kw: refuse(f"a forked process ({argv!r:.120})"))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start",
                        lambda self: refuse("a multiprocessing process"))


@pytest.fixture(scope="module")
def whole_replicas():
    """Jobs of the module keep data parallelism's copies off (``MLCHECKPOINT_DP_COPIES=off``),
    so every replica is a whole shard. Their workers save tensors equal on every rank beside
    per-rank ones (``make_state(step, rank)``); what the modules test is whole shards moving
    between nodes (pushed, cut mid-transfer, fetched to heal a replaced node). With copies,
    only the per-rank items would cross: ``tests/jobs/test_dp_copies.py`` tests that."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLCHECKPOINT_DP_COPIES", "off")
        yield


@pytest.fixture
def store_dir():
    """A fresh directory on tmpfs (/dev/shm), removed after the test, pass or fail."""
    path = tempfile.mkdtemp(prefix="mlckpt-test-", dir="/dev/shm")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def store(store_dir, request):
    """A LocalStore in a fresh tmpfs directory, for the job named by the test module's JOB."""
    s = LocalStore(store_dir, request.module.JOB)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def clean_env(monkeypatch):
    """No job id, local dir or crash point inherited from the environment."""
    for var in MLCHECKPOINT_ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.fixture
def make_job():
    """Factory of Jobs on tmpfs; every process, socket and directory is gone afterwards."""
    made: list[Job] = []
    roots: list[str] = []

    def make(world: int = 2) -> Job:
        root = tempfile.mkdtemp(prefix="mlckpt-faults-", dir="/dev/shm")
        roots.append(root)
        job = Job(root, world)
        made.append(job)
        return job

    try:
        yield make
    finally:
        for job in made:
            job.close()
        for root in roots:
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(autouse=True)
def _environment_restored():
    """A test's changes to ``os.environ`` end with it. A benchmark's ``main()`` run in-process
    set ``MLCHECKPOINT_FLUSH_DEADLINE=3600`` for every later test of its worker, whose jobs
    then kept their abandoned flush folders for two hours (CI, twice). (pytest's own
    PYTEST_CURRENT_TEST, set for each phase, is left to it.)"""
    saved = dict(os.environ)
    yield
    for k in {*saved, *os.environ} - {"PYTEST_CURRENT_TEST"}:
        if k not in saved:
            del os.environ[k]
        elif os.environ.get(k) != saved[k]:
            os.environ[k] = saved[k]


@pytest.fixture
def tcp_warnings(caplog):
    caplog.set_level(logging.WARNING, logger="mlcheckpoint")

    def messages() -> list[str]:
        return [r.getMessage() for r in caplog.records
                if r.name == TCP_LOGGER and r.levelno >= logging.WARNING]

    return messages


# --------------------------------------------------------------------------- parallel runs
# With MLCHECKPOINT_TEST_WORKERS, scripts/test.sh runs the suite on pytest-xdist workers with
# ``--dist loadscope``: a module's tests on one worker, so a launch they share (a module-scoped
# fixture) runs once. (``xdist_group`` marks with ``--dist loadgroup`` would spread a module's
# independent tests, but pytest 9.2 ignores the nodeid suffix xdist 3.8 adds for them.) Here the
# longest modules go first (tests/durations.json, seconds per test from a recorded run;
# ``--no-loadscope-reorder`` keeps this order), so no worker starts a long one at the end.
DURATIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "durations.json")
UNKNOWN_SLOW_S, UNKNOWN_FAST_S = 10.0, 0.1  # a test not in the record yet


# scripts/test.sh runs the suite in two phases (MLCHECKPOINT_TEST_PHASE): "parallel" on the
# workers without the tests marked ``quiet``, then "quiet" with only those, alone on the machine:
# a delay-based pacing test on 2 busy cores reads the other workers' load as a congested link
# (CI: its rate measured alone stayed at a twelfth of the link). Unset: every test, one pass.
PHASE = os.environ.get("MLCHECKPOINT_TEST_PHASE")


def _keep_phase(config: pytest.Config, items: list[pytest.Item]) -> None:
    if PHASE not in ("parallel", "quiet"):
        return
    keep, drop = [], []
    for item in items:
        quiet = item.get_closest_marker("quiet") is not None
        (keep if quiet == (PHASE == "quiet") else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _keep_phase(config, items)
    if not hasattr(config, "workerinput"):
        return  # not an xdist worker: the order of a serial run does not change its time
    try:
        with open(DURATIONS) as f:
            recorded: dict[str, float] = json.load(f)
    except (OSError, ValueError):
        recorded = {}

    def seconds(item: pytest.Item) -> float:
        default = UNKNOWN_SLOW_S if item.get_closest_marker("slow") else UNKNOWN_FAST_S
        return recorded.get(item.nodeid, default)

    # Units of work as xdist's loadscope splits them (a module, or a class); longest first.
    # Every worker computes the same order (xdist requires it).
    units: dict[str, list[pytest.Item]] = {}
    for item in items:
        units.setdefault(item.nodeid.rsplit("::", 1)[0], []).append(item)
    ordered = sorted(units.values(), key=lambda unit: -sum(seconds(i) for i in unit))
    items[:] = [item for unit in ordered for item in unit]


# --------------------------------------------------------------------------- where the CPU goes
# MLCHECKPOINT_TEST_CPU_LOG=FILE: one JSON line per test, its wall seconds (setup, call and
# teardown, a module fixture's launches in the test that set it up), the CPU seconds of this
# process and of the children it reaped (torchrun agents, whose ranks they reaped: a launch's
# whole CPU, except ranks orphaned by a killed agent; agents the fork server forked count as
# children), the Python processes it started and those it had forked.
# scripts/suite_profile.py sums it per module.
CPU_LOG = os.environ.get("MLCHECKPOINT_TEST_CPU_LOG")
_python_starts = [0]
# ... and every process the suite starts writes a line of its own to FILE.procs at its exit
# (tests/startup/sitecustomize.py): its CPU and how much of it was starting and importing.
if CPU_LOG:
    os.environ.setdefault("MLCHECKPOINT_TEST_PROC_LOG", CPU_LOG + ".procs")


def pytest_sessionstart(session: pytest.Session) -> None:
    if not CPU_LOG:
        return
    popen_init = subprocess.Popen.__init__

    def counting_popen_init(self, args, *a, **kw):
        if _starts_python(args):
            _python_starts[0] += 1
        popen_init(self, args, *a, **kw)

    subprocess.Popen.__init__ = counting_popen_init  # type: ignore[method-assign]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    if not CPU_LOG:
        yield
        return
    import resource
    import time

    def cpu(who: int) -> float:
        r = resource.getrusage(who)
        return r.ru_utime + r.ru_stime

    def children() -> float:
        return cpu(resource.RUSAGE_CHILDREN) + forkserver.reaped_cpu_s()

    t0, self0, kids0, starts0, forks0 = (time.monotonic(), cpu(resource.RUSAGE_SELF),
                                         children(), _python_starts[0], forkserver.forks())
    yield
    with open(CPU_LOG, "a") as f:
        f.write(json.dumps({"test": item.nodeid, "slow": item.get_closest_marker("slow") is not None,
                            "wall_s": time.monotonic() - t0,
                            "self_cpu_s": cpu(resource.RUSAGE_SELF) - self0,
                            "children_cpu_s": children() - kids0,
                            "python_starts": _python_starts[0] - starts0,
                            "forks": forkserver.forks() - forks0}) + "\n")


@pytest.fixture
def standin_page_locking(monkeypatch):
    """Page-locking without CUDA: a registration marks the mapping locked (what the pool reads)
    and is counted where a real one is (``buffers.registrations``, by thread name, returned);
    its release clears the mark (CPU torch has no cudaHostUnregister to call)."""
    import threading

    import torch

    from mlcheckpoint.store import buffers
    from mlcheckpoint.store.buffers import MappedFile

    if torch.cuda.is_available():
        pytest.skip("the GPU tests page-lock for real (tests/jobs/test_gpu_jobs.py)")

    def register(mapped, device=None):
        if not mapped._cuda_registered:
            mapped._cuda_registered, mapped._cuda_device = True, device
            buffers.registrations[threading.current_thread().name] += 1

    release = MappedFile.release

    def unregister_then_release(mapped):
        mapped._cuda_registered = False
        release(mapped)

    monkeypatch.setattr(MappedFile, "register_for_device_copies", register)
    monkeypatch.setattr(MappedFile, "release", unregister_then_release)
    return buffers.registrations

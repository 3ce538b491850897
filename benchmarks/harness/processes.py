"""The processes of a benchmark run: its private workspace, helper processes (each in a session
of its own, with a log) and the cleanup of all of them. Simulated nodes (torchrun agents, one
tmpfs directory each) come from ``mlcheckpoint.testing.cluster``, as in the tests and the
demo."""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from .stats import size_str

__all__ = ["REPO_ROOT", "Helpers", "exit_on_sigterm", "make_workspace", "start_parent_watchdog"]

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_workspace(prefix: str, shm_dir: str = "/dev/shm", need_bytes: int = 0) -> str:
    """A private directory under ``shm_dir`` for everything one run writes (the caller removes
    it); refuses to start when the tmpfs has less than ``need_bytes`` free."""
    vfs = os.statvfs(shm_dir)
    free = vfs.f_bavail * vfs.f_frsize
    if free < need_bytes:
        raise SystemExit(f"{shm_dir} has {size_str(free)} free; this run needs about {size_str(need_bytes)}")
    root = tempfile.mkdtemp(prefix=prefix, dir=shm_dir)
    os.chmod(root, 0o700)
    return root


def exit_on_sigterm() -> None:
    """SIGTERM raises SystemExit, so ``finally`` blocks remove what the run wrote."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


def start_parent_watchdog(root: str) -> None:
    """In a helper process: when the parent dies (SIGKILL), remove ``root`` and exit."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                shutil.rmtree(root, ignore_errors=True)
                os._exit(3)

    threading.Thread(target=watch, daemon=True, name="bench-watchdog").start()


class Helpers:
    """The helper processes of one run. Each runs in its own session (so its whole process
    tree can be ended) with its output in ``<root>/<name>.log``; ``close`` ends those still
    running, SIGTERM first, then SIGKILL."""

    def __init__(self, root: str):
        self.root = root
        self.procs: list[tuple[subprocess.Popen, str, str]] = []

    def spawn(self, cmd: list[str], name: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        log_path = os.path.join(self.root, f"{name}.log")
        full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
        full_env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, full_env.get("PYTHONPATH")) if p)
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, cwd=REPO_ROOT)
        self.procs.append((proc, name, log_path))
        return proc

    def log_tail(self, name: str, n: int = 4000) -> str:
        try:
            with open(os.path.join(self.root, f"{name}.log"), errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return ""

    def check(self) -> None:
        """Raise if a helper failed, with the end of its log."""
        for proc, name, _ in self.procs:
            rc = proc.poll()
            if rc not in (None, 0):
                raise RuntimeError(f"helper {name} exited with {rc}; its log ends:\n{self.log_tail(name)}")

    def wait(self, procs: list[subprocess.Popen], timeout: float,
             idle: Callable[[], bool] | None = None) -> None:
        """Wait until ``procs`` exit (or ``idle()`` holds), failing early if any helper fails."""
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs) and not (idle is not None and idle()):
            self.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"helper processes did not finish within {timeout:.0f} s")
            time.sleep(0.005 if idle is not None else 0.05)
        self.check()

    def close(self) -> None:
        for proc, _, _ in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc, _, _ in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        self.procs.clear()
        gc.collect()

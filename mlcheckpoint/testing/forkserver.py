"""Start simulated nodes' torchrun agents by forking one process that has imported torch already.

A simulated node costs about 3.5 CPU-s before it does anything: its agent imports torch (1.4
CPU-s on a quiet 2-core machine) and each rank imports torch, DCP and mlcheckpoint again (2.1).
A test suite that starts a few hundred nodes spends most of its CPU there (tests/README.md,
Running). This server imports them once; each agent is a fork of it that runs torchrun's own
``main`` with the arguments it was given, and the cluster adds ``--run-path
--start-method=fork`` so that torchrun forks the ranks from the agent too (its own supported way
to run a script in the agent's interpreter). Agents and ranks are still separate processes with
their own pids, sessions, sockets and memory, started and signalled by torchrun as usual.

    server = ForkServer()                                  # starts the server process
    proc = server.spawn(argv, env=env, stdout=log_fd)      # a Popen-like handle
    proc.wait(timeout=60); server.close()

Only ``python -m MODULE ...`` and ``python SCRIPT ...`` command lines can be forked. The socket
lies in a directory of its own that only this user can enter (``mkdtemp``): whoever can reach
it can run commands as this user. The server adopts orphans (a child subreaper) and, once its
client is gone (its stdin ends), kills every process it forked or adopted and removes its
socket. The server has no thread of its own when it forks (it checks), so a child never
inherits a lock held by another thread. What a fork cannot give a child, and a fresh
interpreter would: modules imported again under the child's environment. Settings read at
import time (``OMP_NUM_THREADS`` by the OpenMP runtime) are the server's, which it takes from
``SERVER_ENV``; a child's ``PYTHONPATH`` entries are added to its ``sys.path``.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import faulthandler
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

# What every agent and rank of a simulated node imports: the server imports it once.
PRELOAD = ("torch", "torch.distributed.run", "torch.distributed.checkpoint",
           "torch.distributed.elastic.multiprocessing", "numpy", "mlcheckpoint",
           "mlcheckpoint.manager", "mlcheckpoint.testing.cluster")
# The environment the server imports under, where a setting is read once at import.
SERVER_ENV = {"OMP_NUM_THREADS": "1"}
_MAX_REQUEST = 1 << 20


class ForkedProcess:
    """A process the server forked: the part of ``subprocess.Popen`` the clusters use (``pid``,
    ``returncode``, ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``). Its exit
    status comes from the server, its parent; ``cpu_s`` is the CPU it and the children it
    reaped used, once it has exited."""

    def __init__(self, conn: socket.socket, pid: int, args: Sequence[str]):
        self._conn, self.pid, self.args = conn, pid, list(args)
        self.returncode: int | None = None
        self.cpu_s = 0.0
        self._buf = b""
        self._lock = threading.Lock()

    def _read_status(self, timeout: float | None) -> bool:
        """Read the exit report if it comes within ``timeout`` (None: wait for it)."""
        with self._lock:
            if self.returncode is not None:
                return True
            deadline = None if timeout is None else time.monotonic() + timeout
            while b"\n" not in self._buf:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                self._conn.settimeout(left)
                try:
                    chunk = self._conn.recv(4096)
                except (TimeoutError, BlockingIOError):
                    return False
                if not chunk:  # the server is gone: its children were killed with it
                    self.returncode = -signal.SIGKILL
                    self._conn.close()
                    return True
                self._buf += chunk
            report = json.loads(self._buf.split(b"\n", 1)[0])
            self.returncode, self.cpu_s = report["returncode"], report["cpu_s"]
            self._conn.close()
            _reaped_cpu[0] += self.cpu_s
            return True

    def poll(self) -> int | None:
        self._read_status(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._read_status(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


_reaped_cpu = [0.0]
_forks = [0]


def reaped_cpu_s() -> float:
    """CPU seconds of every forked process this process has seen exit (and of their reaped
    children): what ``RUSAGE_CHILDREN`` would count had they been its own children."""
    return _reaped_cpu[0]


def forks() -> int:
    """How many processes this process has had forked."""
    return _forks[0]


_shared: ForkServer | None = None


def shared() -> ForkServer:
    """This process's server, started at the first call."""
    global _shared
    if _shared is None or _shared._proc.poll() is not None:
        _shared = ForkServer()
    return _shared


class ForkServer:
    """The client of one server process, started on creation and stopped by ``close()`` (or
    at this process's exit). Forks are served one at a time."""

    def __init__(self, preload: Sequence[str] = PRELOAD, start_timeout: float = 120):
        self._dir = tempfile.mkdtemp(prefix="mlckpt-forkserver-")
        self.path = os.path.join(self._dir, "sock")
        env = {**os.environ, **SERVER_ENV}
        # Its stdin is how it notices this process is gone (EOF): it then kills what it forked.
        serve = f"import {__name__} as s; s._serve({self.path!r}, {list(preload)!r})"
        self._proc = subprocess.Popen([sys.executable, "-c", serve], stdin=subprocess.PIPE,
                                      env=env, start_new_session=True)
        self._lock = threading.Lock()
        deadline = time.monotonic() + start_timeout
        while not os.path.exists(self.path):
            if self._proc.poll() is not None:
                raise RuntimeError(f"the fork server exited with {self._proc.returncode}")
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the fork server did not start in {start_timeout} s")
            time.sleep(0.02)
        atexit.register(self.close)

    def spawn(self, argv: Sequence[str], *, env: Mapping[str, str], stdout: int,
              cwd: str | None = None, new_session: bool = True,
              hold_open: str | None = None) -> ForkedProcess:
        """Fork a process running ``argv`` (``[python, -m, MODULE, ...]`` or ``[python,
        SCRIPT, ...]``) with environment ``env``, writing stdout and stderr to the file
        descriptor ``stdout``, in a session of its own unless ``new_session`` is False.

        ``hold_open``: a path the child keeps open, and so does every process it forks in turn,
        so they can be found by it (``/proc/PID/fd``): a forked process's ``/proc/PID/environ``
        is the server's, whatever its ``os.environ`` says."""
        request = json.dumps({"argv": list(argv), "env": dict(env), "cwd": cwd or os.getcwd(),
                              "new_session": new_session, "hold_open": hold_open}).encode()
        if len(request) > _MAX_REQUEST:
            raise ValueError(f"a fork request of {len(request)} bytes")
        with self._lock:
            if self._proc.poll() is not None:
                raise RuntimeError(f"the fork server exited with {self._proc.returncode}")
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                conn.connect(self.path)
                socket.send_fds(conn, [request], [stdout])
                conn.shutdown(socket.SHUT_WR)
                line = b""
                while not line.endswith(b"\n"):
                    chunk = conn.recv(4096)
                    if not chunk:
                        raise RuntimeError("the fork server closed the connection before forking")
                    line += chunk
            except BaseException:
                conn.close()
                raise
        reply = json.loads(line)
        if "error" in reply:
            conn.close()
            raise RuntimeError(f"the fork server refused {argv[:3]}: {reply['error']}")
        _forks[0] += 1
        return ForkedProcess(conn, reply["pid"], argv)

    def close(self) -> None:
        """Stop the server (it kills whatever it forked that still runs) and remove its socket."""
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        with contextlib.suppress(OSError):
            os.rmdir(self._dir)


# --------------------------------------------------------------------------- in the server
_PR_SET_CHILD_SUBREAPER = 36


def _kill_descendants() -> None:
    from mlcheckpoint.testing.cluster import process_tree
    for pid in process_tree(os.getpid())[1:]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _serve(path: str, preload: Sequence[str]) -> None:
    try:
        _serve_until_client_ends(path, preload)
    finally:  # nothing it forked outlives it, nor its socket
        _kill_descendants()
        with contextlib.suppress(OSError):
            os.unlink(path)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(path))


def _serve_until_client_ends(path: str, preload: Sequence[str]) -> None:
    for name in preload:
        importlib.import_module(name)
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:  # a fork would copy locks other threads may hold
        raise SystemExit(f"the fork server has {threads} threads after its imports; it needs 1")
    # Ranks orphaned by a killed agent become its children, not init's: it reaps them, and kills
    # them when its client is gone.
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)  # before the name appears: a client connecting at once was refused
    os.rename(path + ".tmp", path)  # the client waits for this name: bound and listening
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(wake_r, selectors.EVENT_READ, "child")
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ, "client")
    children: dict[int, socket.socket] = {}
    while True:
        for key, _ in sel.select():
            if key.data == "client":  # our client exited or closed us
                return
            if key.data == "child":
                os.read(wake_r, 4096)
            else:
                conn, _ = listener.accept()
                forked = _fork_one(conn, [listener, wake_r, wake_w, sys.stdin.fileno()])
                if forked is not None:
                    children[forked] = conn
            _reap(children)


def _reap(children: dict[int, socket.socket]) -> None:
    """Reap every child that ended (orphans adopted too); report those it forked."""
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is None:
            continue
        report = {"returncode": os.waitstatus_to_exitcode(status),
                  "cpu_s": usage.ru_utime + usage.ru_stime}
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps(report).encode() + b"\n")
        conn.close()


def _fork_one(conn: socket.socket, server_fds: list[Any]) -> int | None:
    """Read one request from ``conn`` and fork it; return the child's pid (None: refused)."""
    try:
        conn.settimeout(10)
        data, fds = b"", []
        while True:
            chunk, got, _, _ = socket.recv_fds(conn, 65536, 1)
            fds += got
            if not chunk:
                break
            data += chunk
            if len(data) > _MAX_REQUEST:
                raise ValueError("request too large")
        request = json.loads(data)
        argv = request["argv"]
        if len(fds) != 1:
            raise ValueError(f"{len(fds)} file descriptors with the request")
        if len(argv) < 2 or argv[1] in ("-c", "") or (argv[1] == "-m" and len(argv) < 3):
            raise ValueError(f"cannot fork {argv!r}")
    except (OSError, ValueError, KeyError) as e:
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps({"error": str(e)}).encode() + b"\n")
        conn.close()
        return None
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            for fd in server_fds:
                with contextlib.suppress(OSError):
                    os.close(fd if isinstance(fd, int) else fd.detach())
            conn.close()
            code = _child(argv, request, fds[0])
        except BaseException:  # noqa: BLE001 - said, to the log if it is set up, and ended
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(fds[0])
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    return pid


def _child(argv: list[str], request: dict[str, Any], out: int) -> int:
    """Become what ``argv`` would have started; return its exit code."""
    env, cwd = request["env"], request["cwd"]
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    if request["new_session"]:
        os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(null)
    os.close(out)
    if request["hold_open"]:  # after 0, 1 and 2 are taken: the server's stdin was 0
        os.open(request["hold_open"], os.O_RDONLY)  # never closed: see ForkServer.spawn
    for stream in (sys.stdout, sys.stderr):  # the log sees each line as it is written
        stream.reconfigure(line_buffering=True, write_through=True)  # type: ignore[union-attr]
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    enable_faulthandler_as_set()
    atexit._clear()  # the server's exit handlers are not the child's
    # sys.path as a fresh interpreter would build it: where it runs, then PYTHONPATH.
    first = os.getcwd() if argv[1] == "-m" else os.path.dirname(os.path.abspath(argv[1]))
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *[p for p in extra if p not in sys.path],
                   *[p for p in sys.path[1:] if p != first]]
    code = 0
    try:
        if argv[1] == "-m":
            sys.argv = [argv[2], *argv[3:]]
            runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv[1:]
            runpy.run_path(argv[1], run_name="__main__")
    except SystemExit as e:
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)  # sys.exit("message"), as an interpreter prints it
        code = exit_code(e)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 128 + signal.SIGINT
    except Exception:  # noqa: BLE001 - an uncaught error ends it as it ends an interpreter
        traceback.print_exc()
        code = 1
    # What an interpreter's exit does before it ends: wait for threads, run exit handlers.
    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    return code


def enable_faulthandler_as_set() -> None:
    """What ``PYTHONFAULTHANDLER`` makes an interpreter do at startup, which a forked process
    did not go through: a crash in native code prints every thread's Python stack."""
    if os.environ.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()


def exit_code(e: SystemExit) -> int:
    """The exit status ``e`` ends an interpreter with: 0 for None, an int as the OS keeps it,
    1 for anything else (a message)."""
    if e.code is None:
        return 0
    return e.code & 0xFF if isinstance(e.code, int) else 1


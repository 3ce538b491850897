"""Worker: report what a rank sees of how it was started (tests/jobs/test_forkserver.py): its
signal dispositions, parent-death signal, argv, first import path, session, environment,
working directory, logging and crash reports; once every rank has, exit with argv[2] (a number)
or as it says (raise, sigterm, segfault, sleep[<seconds>], os._exit<code>)."""

import ctypes
import faulthandler
import logging
import os
import signal
import sys
import time

from mlcheckpoint.testing.cluster import write_result

rank = int(os.environ["RANK"])
pdeathsig = ctypes.c_int(-1)
ctypes.CDLL(None).prctl(2, ctypes.byref(pdeathsig), 0, 0, 0)  # PR_GET_PDEATHSIG
logging.basicConfig(level=logging.INFO, format="probe-format %(message)s")
logging.getLogger("probe").info("probe logged at INFO")
write_result(sys.argv[1], rank, {
    "signals": {name: str(signal.getsignal(getattr(signal, name)))
                for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGCHLD", "SIGPIPE")},
    "pdeathsig": pdeathsig.value,
    "argv": sys.argv,
    "path0": sys.path[0],
    "own_session": os.getsid(0) == os.getpid(),
    "env": os.environ.get("PROBE_ENV"),
    "cwd": os.getcwd(),
    "root_handlers": len(logging.root.handlers),
    "faulthandler": faulthandler.is_enabled(),
})
# Both ranks have reported before either ends: the agent stops the other rank at the first failure.
others = [os.path.join(os.environ["TEST_OUT_DIR"], f"{sys.argv[1]}.rank{r}.json")
          for r in range(int(os.environ["WORLD_SIZE"]))]
while not all(os.path.exists(p) for p in others):
    time.sleep(0.01)
how = sys.argv[2]
if how == "raise":
    raise RuntimeError("probe raised")
if how == "segfault":  # a crash in native code
    ctypes.string_at(0)
if how == "sigterm":
    os.kill(os.getpid(), signal.SIGTERM)
if how.startswith("os._exit"):  # as a worker that skips the interpreter's teardown does
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(how[len("os._exit"):]))
if how.startswith("sleep"):  # sleep<seconds>, 120 by default
    time.sleep(float(how[len("sleep"):] or 120))
    how = "0"
sys.exit(int(how))

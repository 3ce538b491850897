"""Run at the start of every Python process the test suite launches (tests/conftest.py puts this
folder on their PYTHONPATH): torchrun agents, their ranks, benchmark and CLI children.

The suite is CPU-bound on 2 cores, and most of a launch's CPU is its processes importing torch
(about 3 to 4 CPU-s each). That import allocates a great many objects that live as long as
the process, and Python's default thresholds (700, 10, 10) run the cyclic collector over them
again and again: the threshold below took the import from 4.17 to 3.90 CPU-s on a quiet 2-core
machine (tests/README.md, Running). Raising the young threshold keeps the collector running,
only less often; nothing the suite tests depends on when a cycle is collected, and the
library's own pauses (``mlcheckpoint/_gc.py``) work the same at any threshold. A user's
process keeps Python's defaults: this file is on no path outside the suite.
"""

import gc
import os

gc.set_threshold(100_000, 50, 50)

# MLCHECKPOINT_TEST_PROC_LOG=FILE (tests/conftest.py sets it beside MLCHECKPOINT_TEST_CPU_LOG):
# every process appends one JSON line at exit: what it ran, its CPU seconds, and its CPU
# seconds since it started at the moment each of a few imports finished (torch, DCP, ours; an
# agent, run as ``-m torch.distributed.run``, imports torch), so scripts/suite_profile.py can
# say how much of the suite's CPU is starting interpreters and importing. A process killed by
# a signal writes nothing (the suite SIGKILLs nodes on purpose).
if os.environ.get("MLCHECKPOINT_TEST_PROC_LOG"):
    import atexit
    import importlib.abc
    import importlib.machinery
    import json
    import resource
    import sys

    _TIMED = ("torch", "torch.distributed.checkpoint", "mlcheckpoint")
    _ready: dict[str, float] = {}  # name -> CPU seconds of this process when its import ended

    def _cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    class _TimeImports(importlib.abc.MetaPathFinder):
        """Notes the CPU at the end of the first import of each of ``_TIMED``."""

        def find_spec(self, name, path=None, target=None):
            if name not in _TIMED or name in _ready:
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None:
                return spec
            exec_module = spec.loader.exec_module

            def timed(module):
                try:
                    exec_module(module)
                finally:
                    _ready[name] = round(_cpu(), 3)
            spec.loader.exec_module = timed  # type: ignore[method-assign]
            return spec

    sys.meta_path.insert(0, _TimeImports())

    def _write() -> None:
        line = json.dumps({"argv": sys.argv[:3], "cpu_s": round(_cpu(), 3), "ready_cpu_s": _ready})
        with open(os.environ["MLCHECKPOINT_TEST_PROC_LOG"], "a") as f:
            f.write(line + "\n")
    atexit.register(_write)

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

gc.set_threshold(100_000, 50, 50)

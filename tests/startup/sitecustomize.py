"""Run at the start of every Python process the test suite launches (tests/conftest.py puts this
folder on their PYTHONPATH): torchrun agents, their ranks, benchmark and CLI children.

The suite is CPU-bound on 2 cores, and most of a launch's CPU is its processes importing torch
(about 3 CPU-s each). That import allocates millions of objects that live as long as the
process, and Python's default thresholds (700, 10, 10) run the cyclic collector over them
again and again: about a seventh of the import's CPU, measured in scripts/suite_profile.py's
notes (tests/README.md, Running). Raising the young threshold keeps the collector running,
only less often; nothing the suite tests depends on when a cycle is collected, and the
library's own pauses (``mlcheckpoint/_gc.py``) work the same at any threshold. A user's
process keeps Python's defaults: this file is on no path outside the suite.
"""

import gc

gc.set_threshold(100_000, 50, 50)

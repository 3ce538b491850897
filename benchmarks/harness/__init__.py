"""What the benchmarks share, one concern per module:

- ``stats``: sizes, medians and percentiles, throughput, timers;
- ``workloads``: seeded state dicts shaped like a model's, and load checks;
- ``baselines``: memcpy, a raw loopback socket, DCP's file system storage;
- ``processes``: the run's workspace, helper processes, torchrun agents of simulated nodes;
- ``report``: progress lines, the machine, and ``run_and_report`` (config -> run -> report).

Each benchmark script is a config, a ``run`` returning a dict of figures, and a report of that
dict. Scripts put the repository root on ``sys.path`` first, so they run both as
``python benchmarks/x.py`` and as ``from benchmarks.x import main``.
"""

"""Tools for testing and benchmarking mlcheckpoint itself; the library never imports them.

``netcluster``: an emulated multi-node cluster on one machine (network namespaces joined by
shaped links), for tests, benchmarks and demos.
"""

from .netcluster import NetCluster, NetNode, available, clean_stale

__all__ = ["NetCluster", "NetNode", "available", "clean_stale"]

"""Tools for testing and benchmarking mlcheckpoint itself; the library never imports them.

``cluster``: simulated multi-node jobs on one machine (torchrun agents, one tmpfs directory
per node, kills, results, cleanup), the one way tests, benchmarks and the demo start nodes.
``netcluster``: the same nodes, each in a network namespace behind a shaped link.
``internals``: a CheckpointManager's parts, for tests that look inside or damage them.
"""

from .cluster import Cluster, Node, SimulatedCluster, free_port, write_result
from .internals import Internals, internals
from .netcluster import NetCluster, NetNode, available, clean_stale

__all__ = ["Cluster", "Internals", "NetCluster", "NetNode", "Node", "SimulatedCluster",
           "available", "clean_stale", "free_port", "internals", "write_result"]

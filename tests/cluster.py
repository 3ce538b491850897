"""Simulated multi-node jobs for the tests: ``mlcheckpoint.testing.cluster``, with worker scripts
named relative to tests/workers.

Losing a node = ``lose_node`` (SIGKILL its agent and ranks) and ``Node.wipe`` (its local_dir).
"""

from __future__ import annotations

import os

from mlcheckpoint.store import LocalStore
from mlcheckpoint.testing.cluster import Cluster as _Cluster
from mlcheckpoint.testing.cluster import (  # re-exported: tests import them from here
    Node,
    NodeTimeout,
    died_of_sigkill,
    free_port,
    is_dead,
    kill_strays,
    lose_node,
    process_tree,
)

HERE = os.path.dirname(os.path.abspath(__file__))
WORKERS = os.path.join(HERE, "workers")
_dead = is_dead  # the name tests use

__all__ = ["WORKERS", "Cluster", "Node", "NodeTimeout", "died_of_sigkill", "free_port", "is_dead",
           "kill_strays", "lose_node", "process_tree"]


class Cluster(_Cluster):
    """N simulated nodes x G ranks running tests/workers/<script>. Use as a context manager:
    everything is cleaned up."""

    def __init__(self, nnodes: int, nproc: int = 1, job_id: str | None = None,
                 launch: str | None = None):
        super().__init__(nnodes, nproc, job_id=job_id, scripts_dir=WORKERS, launch=launch)

    def store(self, node: int, name: str | None = None) -> LocalStore:
        """Job ``name``'s store on ``node`` (``sub_job``; None: the cluster's own job). The
        caller closes it."""
        if name is None:
            return LocalStore(self.nodes[node].local_dir, self.job_id, create=False)
        return self.sub_job_store(node, name)

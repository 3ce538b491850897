"""Layer 3: copies of every node's shards on a partner node.

- ``schedule/``: what is replicated, when and to whom (the replicator, job-wide rounds, the
  pairing of nodes, the protection status);
- ``core/``: what every transport shares and none owns (the ``Transport`` interface, the
  receiving sink, the one request service, the node's send budget, the checks on what a peer
  sends, the keys derived from the job's secret, the rendezvous);
- ``tcp/`` and ``pg/``: the two wire formats; each only moves bytes;
- ``factory.py``: ``make_transport`` builds one by name.

``core/`` imports no wire format; no wire format imports ``schedule/`` (``tests/test_layers.py``).
"""

from .core.rendezvous import Rendezvous
from .core.sink import ReceiveSink, ReplicaReceived
from .core.transport import ReplicationError, Transport
from .schedule.pairing import PairingStrategy, PairwiseRing
from .schedule.replicator import Replicator, StepReplication

__all__ = ["PairingStrategy", "PairwiseRing", "ReceiveSink", "Rendezvous", "ReplicaReceived",
           "ReplicationError", "Replicator", "StepReplication", "Transport"]

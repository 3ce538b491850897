"""Layer 3: copies of every node's shards on a partner node."""

from .pairing import PairingStrategy, PairwiseRing
from .rendezvous import Rendezvous
from .replicator import Replicator, StepReplication
from .sink import ReceiveSink, ReplicaReceived
from .transport import ReplicationError, Transport

__all__ = ["PairingStrategy", "PairwiseRing", "ReceiveSink", "Rendezvous", "ReplicaReceived",
           "ReplicationError", "Replicator", "StepReplication", "Transport"]

"""Layer 3: copies of every node's shards on a partner node."""

from .pairing import PairingStrategy, PairwiseRing
from .rendezvous import Rendezvous
from .replicator import Replicator, StepReplication
from .sink import Pins, ReceiveSink
from .transport import ReplicationError, Transport

__all__ = ["PairingStrategy", "PairwiseRing", "Pins", "ReceiveSink", "Rendezvous",
           "ReplicationError", "Replicator", "StepReplication", "Transport"]

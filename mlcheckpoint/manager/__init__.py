"""The orchestrators: what runs a job's checkpoints across the layers below them.

``checkpoint_manager.py`` (``CheckpointManager``, what users call) builds the rest and passes
each its collaborators: ``manager/saving.py`` (the save path, and the one publish path after every
commit), ``manager/lifecycle.py`` (pins, buffer warming, replicas landing), ``manager/retention.py`` (what a
node keeps), ``manager/claiming.py`` (one live run per job directory), ``manager/persistent_writer.py`` (the
long-term DCP checkpoint beside the memory ones), ``manager/listing.py`` and ``manager/metrics.py`` (what the
manager reports), ``manager/flush.py`` and ``manager/preemption.py`` (the preemption flush). No layer (``integrity``, ``store``, ``dcp``, ``replication``, ``recovery``)
imports this package (``tests/test_layers.py``).
"""

from .checkpoint_manager import CheckpointManager
from .flush import FlushResult
from .listing import CheckpointEntry
from .saving import SaveResult

__all__ = ["CheckpointEntry", "CheckpointManager", "FlushResult", "SaveResult"]

"""Layer 1: the node-local tmpfs store, passive: no threads, no replication, and no imports
but its own parts, layer 0 (``integrity``) and the leaf modules (errors, config, faults)."""

from .layout import ItemLocation
from .local_store import LocalStore, ShardWriter, StepState
from .manifest import Manifest, ManifestItem, MetadataHeader

__all__ = ["ItemLocation", "LocalStore", "Manifest", "ManifestItem", "MetadataHeader",
           "ShardWriter", "StepState"]

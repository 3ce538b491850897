"""Layer 1: the node-local tmpfs store."""

from .layout import ItemLocation
from .local_store import LocalStore, ShardWriter, StepState
from .manifest import Manifest, ManifestItem, MetadataHeader

__all__ = ["ItemLocation", "LocalStore", "Manifest", "ManifestItem", "MetadataHeader",
           "ShardWriter", "StepState"]

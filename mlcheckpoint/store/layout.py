"""File names inside a job directory. The only place that knows the on-disk layout.

    <local_dir>/<job_id>/
        .lock                                 flock for step-level bookkeeping
        steps/<step:012d>/metadata            DCP global metadata (self-verifying, renamed in)
        steps/<step:012d>/rank-<r:05d>.data   raw item bytes of rank r's shard
        steps/<step:012d>/rank-<r:05d>.manifest   per-item checksums; its presence = committed
        steps/<step:012d>/*.partial, *.tmp    in-flight writes: invisible, removed by gc
        pool/rank-<r:05d>-<token>.buf         retired shard buffers kept for reuse (pages stay touched)
        orphans/<step:012d>-<token>/          a complete step a resume did not load, set aside
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

STEPS = "steps"
POOL = "pool"
ORPHANS = "orphans"
METADATA = "metadata"
PARTIAL = ".partial"
TMP = ".tmp"

_STEP_RE = re.compile(r"^(\d{12})$")
_ORPHAN_RE = re.compile(r"^(\d{12})-[0-9a-f]{8}$")
_MANIFEST_RE = re.compile(r"^rank-(\d{5})\.manifest$")
_POOL_RE = re.compile(r"^rank-(\d{5})-[0-9a-f]{16}\.buf$")


def step_dirname(step: int) -> str:
    if not isinstance(step, int) or step < 0 or step >= 10**12:
        raise ValueError(f"step must be an int in [0, 1e12), got {step!r}")
    return f"{step:012d}"


def parse_step_dirname(name: str) -> int | None:
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def orphan_dirname(step: int, token: str) -> str:
    return f"{step_dirname(step)}-{token}"


def parse_orphan_dirname(name: str) -> int | None:
    m = _ORPHAN_RE.match(name)
    return int(m.group(1)) if m else None


def data_name(rank: int) -> str:
    return f"rank-{rank:05d}.data"


def manifest_name(rank: int) -> str:
    return f"rank-{rank:05d}.manifest"


def parse_manifest_name(name: str) -> int | None:
    m = _MANIFEST_RE.match(name)
    return int(m.group(1)) if m else None


def pool_name(rank: int, token: str) -> str:
    return f"rank-{rank:05d}-{token}.buf"


def parse_pool_name(name: str) -> int | None:
    m = _POOL_RE.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class ItemLocation:
    """Where one DCP item lives; stored as ``WriteResult.storage_data`` in the global metadata.

    The checksum travels in the global metadata too, so a reader can verify bytes against what
    the coordinator recorded, whichever node's copy it reads.
    """

    rank: int
    offset: int
    nbytes: int
    checksum: int
    is_tensor: bool = True


def join(*parts: str) -> str:
    return os.path.join(*parts)

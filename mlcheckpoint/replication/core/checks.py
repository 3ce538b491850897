"""What every transport checks in what a peer sends: bounds on the fields of a request, and
the manifest, metadata and byte ranges it names. Whatever carried it (a TCP frame, a sealed
control message), a peer's input goes through here before it is used as a size, an index or a
path; the request service (``service.py``) and the transports' clients call it.
"""

from __future__ import annotations

import bisect

from ...errors import MLCheckpointError, ProtocolError
from ...store import Manifest
from ...store.manifest import MetadataHeader, decode_metadata

__all__ = [
    "MALFORMED",
    "MAX_ERROR_TEXT",
    "MAX_METADATA_BYTES",
    "MAX_RANGES",
    "MAX_STEP",
    "ProtocolError",
    "check_offer",
    "checked_ranges",
    "manifest_from_wire",
    "metadata_from_wire",
    "want_bool",
    "want_int",
    "want_str",
    "within",
]

# Bounds on what a peer's request may name (every transport).
MAX_STEP = 10**12
MAX_RANGES = 1 << 20
MAX_METADATA_BYTES = 4 << 30
# The longest text of an error a reply carries, and that a message repeats of a peer's.
MAX_ERROR_TEXT = 2000


# What a handler turns into an error reply: bad input from a peer must never kill a thread.
MALFORMED = (MLCheckpointError, ValueError, TypeError, KeyError, IndexError, AttributeError,
             OverflowError)


def want_int(obj: dict, key: str, lo: int, hi: int) -> int:
    """A peer-supplied integer field, range-checked (never trusted as a path or size)."""
    v = obj.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v < hi:
        raise ProtocolError(f"field {key!r}={v!r} outside [{lo}, {hi})")
    return v


def want_bool(obj: dict, key: str, default: bool = False) -> bool:
    """A peer-supplied flag: absent means ``default``; anything but true/false is refused."""
    v = obj.get(key, default)
    if not isinstance(v, bool):
        raise ProtocolError(f"field {key!r}={str(v)[:100]!r} is not true or false")
    return v


def want_str(obj: dict, key: str, max_len: int = 256) -> str:
    v = obj.get(key)
    if not isinstance(v, str) or len(v) > max_len:
        raise ProtocolError(f"field {key!r} is not a string of at most {max_len} characters")
    return v


def manifest_from_wire(obj: object, job_id: str, step: int, owner: int) -> Manifest:
    """Rebuild and check a manifest sent by a peer (any malformation is a ProtocolError, an
    unknown checksum algorithm, the manifest's or an item's, among them)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("items"), list):
        raise ProtocolError("malformed manifest")
    try:
        m = Manifest.from_dict(obj)  # (its fields' types and its items' places checked there)
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise ProtocolError(f"malformed manifest: {e}") from None
    if (m.job_id, m.step, m.rank) != (job_id, step, owner):
        raise ProtocolError(f"manifest names {m.job_id}/{m.step}/{m.rank}, expected {job_id}/{step}/{owner}")
    if m.partial and not m.items:  # (its items lie inside the shard: Manifest.from_dict)
        raise ProtocolError(f"partial replica of step {step} rank {owner} lists no item")
    return m


def metadata_from_wire(raw: bytes, job_id: str, step: int) -> MetadataHeader:
    """Check a step's metadata file sent by a peer (its checksum, and that it is of this job and
    step, with fields of the right types); any malformation is a ProtocolError."""
    try:
        header, _ = decode_metadata(raw)  # (its fields' types checked there)
    except (TypeError, ValueError, KeyError, AttributeError, UnicodeDecodeError) as e:
        raise ProtocolError(f"malformed metadata: {e}") from None
    if (header.job_id, header.step) != (job_id, step):
        raise ProtocolError(f"metadata names {header.job_id!r}/{header.step}, expected {job_id}/{step}")
    return header


def checked_ranges(obj: object, data_bytes: int) -> list[tuple[int, int]]:
    """Peer-supplied (offset, nbytes) pairs, each inside a shard of ``data_bytes``."""
    if not isinstance(obj, list) or len(obj) > MAX_RANGES:
        raise ProtocolError("malformed ranges")
    out = []
    for r in obj:
        if (not isinstance(r, list) or len(r) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in r)
                or r[0] < 0 or r[1] < 0 or r[0] + r[1] > data_bytes):
            raise ProtocolError(f"range {str(r)[:100]} outside the shard")
        out.append((r[0], r[1]))
    return out


def within(ranges: list[tuple[int, int]], held: list[tuple[int, int]]) -> bool:
    """Whether every (offset, nbytes) of ``ranges`` lies inside one of the ``held`` ranges
    (sorted, disjoint: ``Manifest.held_ranges``)."""
    starts = [o for o, _ in held]
    for offset, nbytes in ranges:
        i = bisect.bisect_right(starts, offset) - 1
        if nbytes and (i < 0 or offset + nbytes > held[i][0] + held[i][1]):
            return False
    return True


def check_offer(m: Manifest, max_shard_bytes: int) -> None:
    """Every check on a replica a peer offers us, made before anything is allocated for it; both
    transports call it (the one place to add a check on what a replica may be)."""
    if m.data_bytes > max_shard_bytes:
        raise ProtocolError(f"shard of {m.data_bytes} bytes exceeds max_shard_bytes")

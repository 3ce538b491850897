"""Shard manifests and the global-metadata file format."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

from .checksum import ALGORITHM, checksum

FORMAT_VERSION = 1
# A manifest or metadata header larger than this is not ours (or is corrupt): refuse to parse it.
MAX_HEADER_BYTES = 64 << 20


@dataclass
class ManifestItem:
    key: str
    offset: int
    nbytes: int
    checksum: int
    kind: str = "tensor"  # "tensor" or "bytes"
    dtype: str | None = None
    shape: list[int] | None = None


@dataclass
class Manifest:
    """What one rank committed for one step: every item's place and checksum."""

    job_id: str
    step: int
    rank: int
    data_bytes: int
    items: list[ManifestItem] = field(default_factory=list)
    world_size: int = 1
    created: float = field(default_factory=time.time)
    algorithm: str = ALGORITHM
    format: int = FORMAT_VERSION

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("job_id", "step", "rank", "data_bytes", "world_size",
                                           "created", "algorithm", "format")}
        # Built by hand: dataclasses.asdict deep-copies every item and costs ~10 ms per 500 items.
        d["items"] = [{"key": i.key, "offset": i.offset, "nbytes": i.nbytes, "checksum": i.checksum,
                       "kind": i.kind, "dtype": i.dtype, "shape": i.shape} for i in self.items]
        return d

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_dict(), separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> "Manifest":
        return cls.from_dict(json.loads(raw))

    @classmethod
    def from_dict(cls, d: dict) -> "Manifest":
        """Build and check a manifest (from a file or a peer); raises ValueError/TypeError."""
        if not isinstance(d, dict):
            raise ValueError(f"manifest is a JSON {type(d).__name__}, not an object")
        d = dict(d)
        if d.get("format") != FORMAT_VERSION or d.get("algorithm") != ALGORITHM:
            raise ValueError(f"unsupported manifest format {d.get('format')}/{d.get('algorithm')}")
        d["items"] = [ManifestItem(**it) for it in d["items"]]
        m = cls(**d)
        _check_layout(m)
        return m


def _check_layout(m: Manifest) -> None:
    """Reject manifests whose items fall outside the data (corrupt or hostile)."""
    if m.data_bytes < 0 or m.step < 0 or m.rank < 0:
        raise ValueError("negative size, step or rank in manifest")
    for it in m.items:
        if it.offset < 0 or it.nbytes < 0 or it.offset + it.nbytes > m.data_bytes:
            raise ValueError(f"item {it.key!r} lies outside the shard's {m.data_bytes} bytes")


@dataclass
class MetadataHeader:
    """Header line of a step's global-metadata file; the payload is DCP's pickled Metadata."""

    job_id: str
    step: int
    world_size: int
    ranks: list[int]  # ranks whose shards the step needs (those that wrote at least one item)
    total_bytes: int
    payload_bytes: int
    checksum: int
    created: float = field(default_factory=time.time)
    format: int = FORMAT_VERSION


def encode_metadata(header: MetadataHeader, payload: bytes) -> bytes:
    return json.dumps(asdict(header), separators=(",", ":")).encode() + b"\n" + payload


def decode_metadata(raw: bytes) -> tuple[MetadataHeader, bytes]:
    """Parse and verify a metadata file; raises ValueError on any mismatch."""
    nl = raw.find(b"\n", 0, MAX_HEADER_BYTES)
    if nl < 0:
        raise ValueError("metadata file has no header line")
    header = MetadataHeader(**json.loads(raw[:nl]))
    payload = raw[nl + 1:]
    if header.format != FORMAT_VERSION:
        raise ValueError(f"unsupported metadata format {header.format}")
    if len(payload) != header.payload_bytes:
        raise ValueError(f"metadata truncated: {len(payload)} of {header.payload_bytes} bytes")
    if checksum(payload) != header.checksum:
        raise ValueError("metadata checksum mismatch")
    return header, payload

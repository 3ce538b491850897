"""Shard manifests and the global-metadata file format."""

from __future__ import annotations

import dataclasses
import json
import pickle
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import CorruptShardError
from ..integrity import digests
from ..integrity.verify import digest_item, digests_agree
from .layout import ItemLocation

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
    # The checksum's algorithm (integrity/digests.py) where it is not the manifest's: wsum64
    # for an item saved from device memory. Written only then, so an xxh3 item reads as before.
    algorithm: str | None = None


@dataclass
class Manifest:
    """What one rank committed for one step: every item's place and checksum. ``algorithm``
    is the checksums' unless an item names its own."""

    job_id: str
    step: int
    rank: int
    data_bytes: int
    items: list[ManifestItem] = field(default_factory=list)
    world_size: int = 1
    created: float = field(default_factory=time.time)
    algorithm: str = digests.DEFAULT
    format: int = FORMAT_VERSION
    save_id: str = ""  # the save (incarnation of ``step``) these bytes belong to
    run_id: str = ""  # the run of the job that made that save
    # A partial replica: only the items listed are here, at the owner's offsets; the bytes
    # between them are holes (sparse in tmpfs) and are never read. Absent (False): whole.
    partial: bool = False

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("job_id", "step", "rank", "data_bytes", "world_size",
                                           "created", "algorithm", "format", "save_id", "run_id")}
        if self.partial:  # (a whole shard's manifest reads as it did before partial replicas)
            d["partial"] = True
        # Built by hand: dataclasses.asdict deep-copies every item and costs ~10 ms per 500 items.
        d["items"] = [{"key": i.key, "offset": i.offset, "nbytes": i.nbytes, "checksum": i.checksum,
                       "kind": i.kind, "dtype": i.dtype, "shape": i.shape,
                       **({} if i.algorithm is None else {"algorithm": i.algorithm})}
                      for i in self.items]
        return d

    def only(self, items: list[ManifestItem]) -> Manifest:
        """The manifest of a partial replica of this shard holding ``items`` (some of this
        manifest's), at the same offsets."""
        return dataclasses.replace(self, items=sorted(items, key=lambda it: it.offset),
                                   partial=True)

    def held_ranges(self) -> list[tuple[int, int]]:
        """(offset, nbytes) of the bytes this shard holds, in order: the whole data, or, for a
        partial replica, its items' ranges (adjacent and overlapping ones merged)."""
        if not self.partial:
            return [(0, self.data_bytes)] if self.data_bytes else []
        out: list[tuple[int, int]] = []
        for it in sorted(self.items, key=lambda it: it.offset):
            if not it.nbytes:
                continue
            if out and it.offset <= out[-1][0] + out[-1][1]:
                start, n = out[-1]
                out[-1] = (start, max(n, it.offset + it.nbytes - start))
            else:
                out.append((it.offset, it.nbytes))
        return out

    @property
    def held_bytes(self) -> int:
        """The bytes this shard holds (a partial replica: its items')."""
        return sum(n for _, n in self.held_ranges())

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_dict(), separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> Manifest:
        return cls.from_dict(json.loads(raw))

    @classmethod
    def from_dict(cls, d: dict) -> Manifest:
        """Build and check a manifest (from a file or a peer); raises ValueError/TypeError."""
        if not isinstance(d, dict):
            raise TypeError(f"manifest is a JSON {type(d).__name__}, not an object")
        d = dict(d)
        if d.get("format") != FORMAT_VERSION or d.get("algorithm") not in digests.ALGORITHMS:
            raise ValueError(f"unsupported manifest format {d.get('format')}/{d.get('algorithm')}")
        d["items"] = [ManifestItem(**it) for it in d["items"]]
        m = cls(**d)
        for it in m.items:
            if it.algorithm is not None:
                digests.check(it.algorithm)
            elif m.algorithm != digests.DEFAULT:
                it.algorithm = m.algorithm  # in memory, an item without one is xxh3's
        _check_layout(m)
        return m


def _check_int(value: object, name: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name}={str(value)[:100]!r} is not an integer")


def _check_origin(job_id: object, created: object) -> None:
    """The job id (text) and creation time (a number) a manifest and a header both carry."""
    if not isinstance(job_id, str) or not isinstance(created, (int, float)) \
            or isinstance(created, bool):
        raise TypeError("malformed job id or creation time")


def _check_layout(m: Manifest) -> None:
    """Reject a manifest whose fields have the wrong types or whose items fall outside the
    data (corrupt or hostile): the one check of a manifest, read from a file or sent by a peer."""
    for name in ("step", "rank", "data_bytes", "world_size", "format"):
        _check_int(getattr(m, name), name)
    _check_origin(m.job_id, m.created)
    if m.data_bytes < 0 or m.step < 0 or m.rank < 0:
        raise ValueError("negative size, step or rank in manifest")
    if not isinstance(m.partial, bool):
        raise TypeError(f"partial={str(m.partial)[:100]!r} is not true or false")
    check_identity(m.run_id, m.save_id)
    for it in m.items:  # (``type(...) is``: a bool is no integer, and a large model lists many)
        if type(it.key) is not str or type(it.kind) is not str or \
                (it.dtype is not None and type(it.dtype) is not str):
            raise TypeError(f"item key/kind/dtype {it.key!r}/{it.kind!r}/{it.dtype!r}")
        if type(it.offset) is not int or type(it.nbytes) is not int or type(it.checksum) is not int:
            raise TypeError(f"item {it.key!r}: offset, size or checksum is not an integer")
        if it.shape is not None and (type(it.shape) is not list
                                     or any(type(n) is not int for n in it.shape)):
            raise TypeError(f"item {it.key!r}: shape {str(it.shape)[:100]!r} is not a list of integers")
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
    save_id: str = ""  # every shard of this save names the same id in its manifest
    run_id: str = ""
    # The runs this save descends from: (run id, newest step of that run it builds on), oldest
    # first. Recovery uses it to refuse steps of another incarnation of the job.
    lineage: list[list] = field(default_factory=list)
    # Each node's copies mode at this save (``dcp/copies.py``: "dp-copies", "dedup", "unique"),
    # as the coordinator chose; empty without copies. ``stats()`` reads it from here, which
    # holds also when DCP committed the save in another process.
    copy_modes: list[str] = field(default_factory=list)


def check_identity(run_id: object, save_id: object) -> None:
    """Ids are short printable tokens (they travel in headers a peer sends)."""
    for name, value in (("run_id", run_id), ("save_id", save_id)):
        if not isinstance(value, str) or len(value) > 64 or not value.isascii():
            raise ValueError(f"malformed {name} {value!r}")


def _check_header(header: MetadataHeader) -> None:
    """Refuse a header whose fields are malformed, read from a file or sent by a peer: fields
    of the wrong types, ranks outside the world, its ids, its lineage (at most
    ``MAX_LINEAGE`` [run id, step] pairs) and its copies modes (short words, one per node)."""
    for name in ("step", "world_size", "total_bytes", "payload_bytes", "checksum", "format"):
        _check_int(getattr(header, name), name)
    _check_origin(header.job_id, header.created)
    if header.step < 0 or header.world_size < 1:
        raise ValueError(f"step {header.step} of a world of {header.world_size} ranks")
    if not isinstance(header.ranks, list) or len(header.ranks) > header.world_size:
        raise TypeError("ranks is not a list of the world's ranks")
    for r in header.ranks:
        _check_int(r, "rank")
        if not 0 <= r < header.world_size:
            raise ValueError(f"rank {r} outside a world of {header.world_size} ranks")
    check_identity(header.run_id, header.save_id)
    lineage = header.lineage
    if not isinstance(lineage, list) or len(lineage) > MAX_LINEAGE:
        raise ValueError("malformed lineage")
    for entry in lineage:
        if (not isinstance(entry, list) or len(entry) != 2 or not isinstance(entry[1], int)
                or isinstance(entry[1], bool)):
            raise ValueError(f"malformed lineage entry {entry!r}")
        check_identity(entry[0], "")
    modes = header.copy_modes
    if not isinstance(modes, list) or len(modes) > MAX_NODES or not all(
            isinstance(m, str) and len(m) <= 16 for m in modes):
        raise ValueError("malformed copy modes")


# The header field of the copy groups, before they were derived from the items' locations.
OLD_COPY_GROUPS = "copy_groups"
# Nodes a header's copies modes may name (a corrupt or hostile file is refused, not parsed on).
MAX_NODES = 1 << 20
# Ancestor runs remembered in a header; older ones no longer matter to a resume.
MAX_LINEAGE = 32


def encode_metadata(header: MetadataHeader, payload: bytes) -> bytes:
    return json.dumps(asdict(header), separators=(",", ":")).encode() + b"\n" + payload


def decode_metadata(raw: bytes) -> tuple[MetadataHeader, bytes]:
    """Parse and verify a metadata file; raises ValueError or TypeError on any mismatch (the
    store reports it as CorruptShardError, the wire as ProtocolError)."""
    nl = raw.find(b"\n", 0, MAX_HEADER_BYTES)
    if nl < 0:
        raise ValueError("metadata file has no header line")
    fields = json.loads(raw[:nl])
    if not isinstance(fields, dict):
        raise TypeError("metadata header is not an object")
    # Headers written before copies were recorded once (in the items' locations alone)
    # carried the copy groups too: derived from the locations now, the field is dropped.
    fields.pop(OLD_COPY_GROUPS, None)
    header = MetadataHeader(**fields)
    _check_header(header)
    payload = raw[nl + 1:]
    if header.format != FORMAT_VERSION:
        raise ValueError(f"unsupported metadata format {header.format}")
    if len(payload) != header.payload_bytes:
        raise ValueError(f"metadata truncated: {len(payload)} of {header.payload_bytes} bytes")
    if not digests_agree(header.checksum, digest_item(payload)):
        raise ValueError("metadata checksum mismatch")
    return header, payload


def dcp_metadata(payload: bytes) -> Any:
    """DCP's Metadata from a verified metadata payload (our own file, checksummed, never a
    peer's unverified bytes), every item located by an ``ItemLocation``."""
    try:
        metadata = pickle.loads(payload)
        locations = list(metadata.storage_data.values())
    except Exception as e:  # noqa: BLE001 (an unpicklable payload is a corrupt file, whatever pickle raised)
        raise CorruptShardError(f"metadata payload is not DCP metadata: {e!r}") from None
    if not all(isinstance(loc, ItemLocation) for loc in locations):
        raise CorruptShardError("metadata items were not written by mlcheckpoint")
    return metadata


def item_locations(payload: bytes) -> list[ItemLocation]:
    """Where every item of a step lives, with its checksum, from a verified metadata payload."""
    return list(dcp_metadata(payload).storage_data.values())

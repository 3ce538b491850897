"""Wire format of the TCP transport: authenticated handshake, then framed JSON + raw payloads;
and the checks on what any peer sends (both transports).

Handshake (before either side reads anything else):
    server -> b"MLCK" version(1) nonce_s(32)
    client -> nonce_c(32) HMAC(secret, "client" | nonce_s | nonce_c)
    server -> HMAC(secret, "server" | nonce_c | nonce_s)     (or closes: stranger)
Frames: b"MLCF" + u32 length + JSON object. A payload, when a frame announces one, follows
raw. Every length is bounded before anything is allocated; every read has a timeout.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import os
import socket
import struct
from collections.abc import Callable

from ..errors import MLCheckpointError, ProtocolError
from ..store import Manifest
from ..store.manifest import MetadataHeader, decode_metadata

MAGIC = b"MLCK"
FRAME = b"MLCF"
VERSION = 1
NONCE = 32
GREETING_BYTES = len(MAGIC) + 1 + NONCE
CLIENT_REPLY_BYTES = NONCE + 32
MAX_FRAME_BYTES = 16 << 20  # JSON headers (a manifest of many thousand items fits)
# Bounds on what a peer's request may name (both transports).
MAX_STEP = 10**12
MAX_RANGES = 1 << 20
MAX_METADATA_BYTES = 4 << 30


# What a handler turns into an error reply: bad input from a peer must never kill a thread.
MALFORMED = (MLCheckpointError, ValueError, TypeError, KeyError, IndexError, AttributeError,
             OverflowError)


class PeerClosed(ProtocolError):
    """The peer closed the connection before a read was complete; ``got`` bytes of it came.
    With ``got == 0`` between requests, that is how a client says it is done."""

    def __init__(self, got: int, wanted: int):
        super().__init__(f"connection closed after {got} of {wanted} bytes")
        self.got = got


def _mac(secret: bytes, label: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(secret, label + a + b, hashlib.sha256).digest()


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf))
    return bytes(buf)


def recv_growing(sock: socket.socket, n: int, chunk: int = 1 << 20) -> bytes:
    """Receive ``n`` bytes, allocating only as they arrive: a peer's claimed size is never
    allocated up front."""
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(min(chunk, n - len(buf)))
        if not part:
            raise PeerClosed(len(buf), n)
        buf += part
    return bytes(buf)


def recv_into_exact(sock: socket.socket, view: memoryview,
                    on_progress: Callable[[int], None] | None = None) -> None:
    """Fill ``view`` from the socket (straight into the destination: no intermediate copy);
    ``on_progress(got)`` is called with the bytes landed so far after every read."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], min(n - got, 64 << 20))
        if k == 0:
            raise PeerClosed(got, n)
        got += k
        if on_progress is not None:
            on_progress(got)


def greeting() -> tuple[bytes, bytes]:
    """What a server sends first, and the nonce it must remember to check the reply."""
    nonce_s = os.urandom(NONCE)
    return MAGIC + bytes([VERSION]) + nonce_s, nonce_s


def answer_client(secret: bytes, nonce_s: bytes, reply: bytes) -> bytes:
    """The server's proof for a client whose ``reply`` to our greeting is right; raises
    ProtocolError for a stranger."""
    nonce_c, mac = reply[:NONCE], reply[NONCE:]
    expected = _mac(secret, b"client", nonce_s, nonce_c)
    if len(reply) != CLIENT_REPLY_BYTES or not hmac.compare_digest(mac, expected):
        raise ProtocolError("peer failed authentication")
    return _mac(secret, b"server", nonce_c, nonce_s)


def server_handshake(sock: socket.socket, secret: bytes) -> None:
    """The server side on a blocking socket (the TCP listener runs the same steps in its gate)."""
    hello, nonce_s = greeting()
    sock.sendall(hello)
    sock.sendall(answer_client(secret, nonce_s, recv_exact(sock, CLIENT_REPLY_BYTES)))


def client_handshake(sock: socket.socket, secret: bytes) -> None:
    hello = recv_exact(sock, GREETING_BYTES)
    if hello[:4] != MAGIC or hello[4] != VERSION:
        raise ProtocolError("not an mlcheckpoint replication endpoint (bad greeting)")
    nonce_s = hello[5:]
    nonce_c = os.urandom(NONCE)
    sock.sendall(nonce_c + _mac(secret, b"client", nonce_s, nonce_c))
    proof = recv_exact(sock, 32)
    if not hmac.compare_digest(proof, _mac(secret, b"server", nonce_c, nonce_s)):
        raise ProtocolError("replication endpoint failed authentication")


def send_frame(sock: socket.socket, obj: dict) -> None:
    body = json.dumps(obj, separators=(",", ":")).encode()
    sock.sendall(FRAME + struct.pack("!I", len(body)) + body)


def recv_frame(sock: socket.socket) -> dict:
    head = recv_exact(sock, 8)
    if head[:4] != FRAME:
        raise ProtocolError("malformed frame (bad magic)")
    (n,) = struct.unpack("!I", head[4:])
    if n > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {n} bytes exceeds the {MAX_FRAME_BYTES} byte limit")
    try:
        obj = json.loads(recv_exact(sock, n))
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(f"malformed frame: {e}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("malformed frame: not an object")
    return obj


def use_kernel_timeouts(sock: socket.socket, seconds: float) -> None:
    """Blocking socket with SO_RCVTIMEO/SO_SNDTIMEO instead of Python's timeout mode.

    Python's timeout mode polls before every recv/send (and turns sendfile into a poll loop):
    10-25% slower on a 1 GiB transfer here. Kernel timeouts bound every wait just the same; a
    wait that expires raises an OSError (EAGAIN), which callers treat like any broken transfer.
    """
    sock.settimeout(None)
    tv = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def sendfile_all(sock: socket.socket, fd: int, offset: int, count: int) -> None:
    """os.sendfile until ``count`` bytes are sent (kernel timeouts end a stuck peer)."""
    end = offset + count
    while offset < end:
        try:
            sent = os.sendfile(sock.fileno(), fd, offset, end - offset)
        except BlockingIOError:
            raise ProtocolError("peer stopped reading (send timed out)") from None
        except OSError as e:
            if e.errno == errno.EINTR:
                continue
            raise
        if sent == 0:
            raise ProtocolError(f"sendfile stopped {end - offset} bytes short (file truncated?)")
        offset += sent


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
    """Rebuild and check a manifest sent by a peer (any malformation is a ProtocolError)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("items"), list):
        raise ProtocolError("malformed manifest")
    try:
        m = Manifest.from_dict(obj)
        for name in ("step", "rank", "data_bytes", "world_size", "format"):
            _check_int(getattr(m, name), name)
        if not isinstance(m.created, (int, float)):
            raise TypeError(f"created={m.created!r} is not a number")
        for it in m.items:
            if not all(isinstance(v, str) for v in (it.key, it.kind)) or \
                    not isinstance(it.dtype, (str, type(None))):
                raise ValueError(f"item key/kind/dtype {it.key!r}/{it.kind!r}/{it.dtype!r}")
            for name in ("offset", "nbytes", "checksum"):
                _check_int(getattr(it, name), f"item {name}")
            if it.shape is not None:
                if not isinstance(it.shape, list):
                    raise ValueError(f"item shape {it.shape!r} is not a list")
                for n in it.shape:
                    _check_int(n, "item shape")
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise ProtocolError(f"malformed manifest: {e}") from None
    if (m.job_id, m.step, m.rank) != (job_id, step, owner):
        raise ProtocolError(f"manifest names {m.job_id}/{m.step}/{m.rank}, expected {job_id}/{step}/{owner}")
    return m


def metadata_from_wire(raw: bytes, job_id: str, step: int) -> MetadataHeader:
    """Check a step's metadata file sent by a peer (its checksum, and that it is of this job and
    step, with fields of the right types); any malformation is a ProtocolError."""
    try:
        header, _ = decode_metadata(raw)
        for name in ("step", "world_size", "total_bytes", "payload_bytes", "checksum", "format"):
            _check_int(getattr(header, name), name)
        if not isinstance(header.ranks, list):
            raise TypeError("ranks is not a list")
        for r in header.ranks:
            _check_int(r, "rank")
    except (TypeError, ValueError, KeyError, AttributeError, UnicodeDecodeError) as e:
        raise ProtocolError(f"malformed metadata: {e}") from None
    if (header.job_id, header.step) != (job_id, step):
        raise ProtocolError(f"metadata names {header.job_id!r}/{header.step}, expected {job_id}/{step}")
    return header


def _check_int(v: object, name: str) -> None:
    if not isinstance(v, int) or isinstance(v, bool):
        raise TypeError(f"{name}={v!r} is not an integer")


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


def check_offer(m: Manifest, max_shard_bytes: int) -> None:
    """Every check on a replica a peer offers us, made before anything is allocated for it; both
    transports call it (the one place to add a check on what a replica may be)."""
    if m.data_bytes > max_shard_bytes:
        raise ProtocolError(f"shard of {m.data_bytes} bytes exceeds max_shard_bytes")

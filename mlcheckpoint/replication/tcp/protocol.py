"""Wire format of the TCP transport: authenticated handshake, then framed JSON + raw payloads.
What a request may say is checked in ``core/checks.py``, as for every transport.

Handshake (before either side reads anything else):
    server -> b"MLCK" version(1) nonce_s(32)
    client -> nonce_c(32) HMAC(secret, "client" | nonce_s | nonce_c)
    server -> HMAC(secret, "server" | nonce_c | nonce_s)     (or closes: stranger)
Frames: b"MLCF" + u32 length + JSON object. A payload, when a frame announces one, follows
raw. Every length is bounded before anything is allocated; every read has a timeout.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from collections.abc import Callable

from ...errors import ProtocolError
from ..core import keys

MAGIC = b"MLCK"
FRAME = b"MLCF"
VERSION = 1
NONCE = 32
GREETING_BYTES = len(MAGIC) + 1 + NONCE
CLIENT_REPLY_BYTES = NONCE + 32
MAX_FRAME_BYTES = 16 << 20  # JSON headers (a manifest of many thousand items fits)


class PeerClosed(ProtocolError):
    """The peer closed the connection before a read was complete; ``got`` bytes of it came.
    With ``got == 0`` between requests, that is how a client says it is done."""

    def __init__(self, got: int, wanted: int):
        super().__init__(f"connection closed after {got} of {wanted} bytes")
        self.got = got


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


def recv_pieces(sock: socket.socket, array, pieces: list[tuple[int, int]],
                on_progress: Callable[[int], None] | None = None) -> None:
    """Fill the ``pieces`` (offset, nbytes) of ``array`` (uint8) from the socket, in order;
    ``on_progress(got)`` with the bytes of all the pieces landed so far."""
    before = 0
    for offset, nbytes in pieces:
        if not nbytes:
            continue
        progress = None if on_progress is None else (lambda got, b=before: on_progress(b + got))
        recv_into_exact(sock, array[offset:offset + nbytes].data, progress)
        before += nbytes


def greeting() -> tuple[bytes, bytes]:
    """What a server sends first, and the nonce it must remember to check the reply."""
    nonce_s = os.urandom(NONCE)
    return MAGIC + bytes([VERSION]) + nonce_s, nonce_s


def answer_client(secret: bytes, nonce_s: bytes, reply: bytes) -> bytes:
    """The server's proof for a client whose ``reply`` to our greeting is right; raises
    ProtocolError for a stranger."""
    nonce_c, mac = reply[:NONCE], reply[NONCE:]
    expected = keys.proof(secret, b"client", nonce_s, nonce_c)
    if len(reply) != CLIENT_REPLY_BYTES or not keys.proves(mac, expected):
        raise ProtocolError("peer failed authentication")
    return keys.proof(secret, b"server", nonce_c, nonce_s)


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
    sock.sendall(nonce_c + keys.proof(secret, b"client", nonce_s, nonce_c))
    proof = recv_exact(sock, 32)
    if not keys.proves(proof, keys.proof(secret, b"server", nonce_c, nonce_s)):
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



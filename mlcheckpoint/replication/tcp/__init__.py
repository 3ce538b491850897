"""The TCP wire format: ``transport.py`` (``TcpTransport``, and ``TcpWire``, the calling half
over which ``core/transport.py`` asks), ``server.py`` (the listener), ``gate.py``
(its login), ``striping.py`` (a shard over several streams) and ``protocol.py`` (handshake and
frames)."""

"""The TCP wire format: ``transport.py`` (``TcpTransport``, and ``TcpWire``, the calling half
that the one client, ``core/client.py``, asks over), ``server.py`` (the listener), ``gate.py``
(its login), ``striping.py`` (a shard over several streams) and ``protocol.py`` (handshake and
frames)."""

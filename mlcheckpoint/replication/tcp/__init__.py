"""The TCP wire format: ``transport.py`` (``TcpTransport``, the calling half), ``server.py``
(the listener), ``gate.py`` (its login), ``striping.py`` (a shard over several streams) and
``protocol.py`` (handshake and frames)."""

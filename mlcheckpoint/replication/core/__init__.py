"""What every transport shares and none owns. Imports no wire format (``tcp/``, ``pg/``).

- ``transport.py``: the ``Transport`` interface (a transport only moves bytes);
- ``service.py``: ``RequestService``, the meaning of every request a peer makes, whatever
  carried it; a transport's listener hands it the request and a ``Channel`` back;
- ``client.py``: ``PeerClient``, the same requests asked of a peer, once for every transport:
  their reply statuses, the fetched manifest, the sink's commit, the error wording; a
  transport hands it its ``Wire``, how a request, its replies and its bytes move;
- ``sink.py``: ``ReceiveSink``, where every received replica lands (verified, committed,
  published as ``ReplicaReceived``), and the step pins it holds (``store/pins.py``);
- ``checks.py``: the bounds and checks on every field a peer sends;
- ``budget.py``: the node's bandwidth budget, which paces what is sent in the background;
- ``keys.py``: every key derived from the job's secret, and what is proved or sealed with one;
- ``rendezvous.py``: the job's c10d store under our prefix, and the secret;
- ``network.py``: which interface and address replication uses, and the link's speed;
- ``streams.py``: ``run_streams``, several streams of one transfer side by side, and
  ``split_evenly``, how their work is dealt.
"""

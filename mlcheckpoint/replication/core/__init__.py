"""What every transport shares and none owns. Imports no wire format (``tcp/``, ``pg/``).

- ``transport.py``: ``Transport`` (a transport only moves bytes), which asks a peer the same
  requests once for every transport: their reply statuses, the sink's commit, the error
  wording; each transport gives it its ``Wire``, how a request, its replies and its bytes move;
- ``service.py``: ``RequestService``, the meaning of every request a peer makes, whatever
  carried it; a transport's listener hands it the request and a ``Channel`` back;
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

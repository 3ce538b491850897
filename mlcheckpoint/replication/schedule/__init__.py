"""What is replicated, when and to whom: the ``Replicator`` (one rank's thread), the job-wide
``Rounds`` (``rounds.py``), the pairing of nodes (``pairing.py``) and what is protected
(``status.py``). It sends through any ``core.Transport``; no transport imports it."""

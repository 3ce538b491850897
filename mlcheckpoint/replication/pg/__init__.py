"""The process-group wire format: ``transport.py`` (``PgTransport``: bytes by torch.distributed
send/recv on a dedicated group; ``PgWire``, over which ``core/transport.py`` asks)
and ``control.py`` (its sealed mailbox in the c10d store and the per-node doorbell)."""

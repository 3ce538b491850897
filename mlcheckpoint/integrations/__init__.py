"""Framework integrations. Each module imports its framework; the core never imports these.

- ``mlcheckpoint.integrations.torchtitan``: a torchtitan checkpointer
  (``pip install mlcheckpoint[torchtitan]``).
- ``mlcheckpoint.integrations.lightning``: a Lightning ``ModelParallelStrategy``
  (``pip install mlcheckpoint[lightning]``).
"""

"""A torchtitan 0.3.0 config registry that checkpoints to memory with mlcheckpoint.

    torchrun --nproc-per-node=8 --rdzv-id=$JOB_ID -m torchtitan.train \
        --module examples.torchtitan_config --config llama3_debugmodel_mlcheckpoint

(run from the directory holding ``examples/``, or put it on PYTHONPATH). The trainer is
torchtitan's own; only the checkpointer changes: every ``interval`` steps to tmpfs and the
partner node, every ``persistent_interval`` steps torchtitan's own ``step-N`` into
``checkpoint.folder``, and at start the newest of both. ``examples/torchtitan_cpu.sh`` runs
this on CPU. See docs/integration.md.
"""

from torchtitan.models.llama3.config_registry import llama3_debugmodel

from mlcheckpoint.integrations.torchtitan import MemoryCheckpointManager


def llama3_debugmodel_mlcheckpoint():
    config = llama3_debugmodel()
    config.checkpoint = MemoryCheckpointManager.Config(
        enable=True,
        interval=2,                # to memory and the partner node
        persistent_interval=4,     # torchtitan's own checkpoint in its folder
        keep_latest_k=2,
        last_save_model_only=False,
        keep=2,                    # in-memory steps kept per rank
    )
    return config

"""A torchtitan checkpointer that saves to memory, with torchtitan's own folder as the fallback.

Select it in a config-registry function (see docs/integration.md)::

    from mlcheckpoint.integrations.torchtitan import MemoryCheckpointManager

    def llama3_debugmodel_mlckpt():
        config = llama3_debugmodel()
        config.checkpoint = MemoryCheckpointManager.Config(
            enable=True, interval=10, persistent_interval=500, keep_latest_k=3)
        return config

- every ``interval`` steps the whole training state goes to tmpfs and to the partner node
  (``interval`` stays the trainer's checkpoint cadence: it also sizes the dataloader's snapshots);
- every ``persistent_interval`` steps (a multiple of ``interval``), and at the first/last step
  as torchtitan's settings say, torchtitan writes its own DCP checkpoint ``step-N`` into its
  folder, with its ``async_mode``; ``keep_latest_k`` becomes mlcheckpoint's
  ``keep_persistent``, whose purge never removes the newest complete step for one still being
  written (torchtitan's own counts every ``step-N`` folder);
- at start, the newest of: a step in memory (local or on the partner node) and the newest
  ``step-N`` in the folder is loaded, once. With neither, torchtitan's own start runs
  (a ``step-0`` seed checkpoint, ``initial_load_path``, HF weights, or a fresh start).
  An explicit ``load_step`` loads that step from the folder, as torchtitan does.

Supported: torchtitan 0.3.0, and its main branch since the ``CheckpointStorage`` seam
(pytorch/torchtitan#4186; tested at b5bcd76). Its checkpointer API still changes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from torchtitan.components import checkpointer as torchtitan_checkpointer
from torchtitan.components.checkpointer.base import MODEL
from torchtitan.components.checkpointer.dcp import CheckpointManager

from ..errors import ConfigError, MLCheckpointError
from ..manager import CheckpointManager as MemoryCheckpoints
from ..persistent import PersistentStorage
from ..recovery import ResumeInfo
from ..settings import DEPRECATED_KEYWORDS, Options, ReplicationOptions, default

SUPPORTED_TORCHTITAN = "0.3.0"
log = logging.getLogger(__name__)


def _check_version() -> None:
    # Main's checkpointer has the CheckpointStorage seam; a checkout of main carries no version
    # of its own (its metadata, if any, is whatever release is installed beside it).
    if hasattr(torchtitan_checkpointer, "CheckpointStorage"):
        return
    try:
        found = version("torchtitan")
    except PackageNotFoundError:
        found = "unknown"
    if found != SUPPORTED_TORCHTITAN:
        raise ImportError(
            f"mlcheckpoint.integrations.torchtitan supports torchtitan=={SUPPORTED_TORCHTITAN} "
            f"and torchtitan's main branch, found {found}: its checkpointer API changes between "
            f"releases. Install 'mlcheckpoint[torchtitan]' (torchtitan=={SUPPORTED_TORCHTITAN}).")


_check_version()


class TorchtitanFolder(PersistentStorage):
    """torchtitan's checkpoint folder as mlcheckpoint's persistent tier: its newest ``step-N``
    is found and loaded by torchtitan's own code (``_find_load_step``, ``dcp_load``).

    A preemption flush writes the step memory holds as ``step-N`` there: memory holds the
    flattened state dict torchtitan's own saves write, so the flushed folder is the DCP
    checkpoint torchtitan would have written, and its own load reads it."""

    flushable = True

    def __init__(self, checkpointer: CheckpointManager):
        super().__init__(checkpointer.folder, step_format="step-{step}")
        self.checkpointer = checkpointer

    def steps(self) -> list[int]:
        # step-0 is a model-only seed checkpoint, which torchtitan's own start loads.
        newest = self.checkpointer._find_load_step()
        return [newest] if newest > 0 else []

    def restore(self, state_dict: dict[str, Any], step: int, load: Callable) -> None:
        log.info("mlcheckpoint: loading step %d from torchtitan's folder %s", step, self.location)
        self.checkpointer.dcp_load(state_dict, checkpoint_id=self.checkpointer._create_checkpoint_id(step),
                                   from_hf=False, from_quantized=False)


def keep_persistent(config: CheckpointManager.Config) -> int | None:
    """The ``keep_persistent`` of a config: its own, else torchtitan's ``keep_latest_k``
    (0: keep all)."""
    given = getattr(config, "keep_persistent", None)
    return given if given is not None else (config.keep_latest_k or None)


class MemoryCheckpointManager(CheckpointManager):
    """torchtitan's DCP checkpoint manager, saving every ``interval`` steps to memory."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        persistent_interval: int = 0
        """Steps between torchtitan's own checkpoints in ``folder``: a multiple of ``interval``;
        0: only those torchtitan's first/last-step settings ask for."""

        local_dir: str | None = None
        """tmpfs directory (default $MLCHECKPOINT_LOCAL_DIR or /dev/shm/mlcheckpoint)."""

        job_id: str | None = None
        """Job id (default $MLCHECKPOINT_JOB_ID, torchrun's --rdzv-id, $SLURM_JOB_ID, else one
        derived from the checkpoint folder)."""

        keep: int = default("keep")
        """In-memory checkpoints kept per rank."""

        keep_persistent: int | None = None
        """Complete ``step-N`` folders kept (default: ``keep_latest_k``, 0 meaning all)."""

        memory_limit: str | None = None
        """Cap on this job's tmpfs use per node, e.g. "64GiB" (default $MLCHECKPOINT_MEMORY_LIMIT)."""

        replication: ReplicationOptions = field(default_factory=ReplicationOptions)
        """How shards reach partner nodes: ``ReplicationOptions(mode=..., streams=...,
        replicas=...)``, as ``CheckpointManager(replication=...)``; a mode string ("pg") is
        taken as ``ReplicationOptions(mode="pg")``."""

        # The flat replication settings of earlier releases: for this release still, with a
        # DeprecationWarning naming the ReplicationOptions field.
        replication_host: str | None = None
        replication_interface: str | None = None
        replication_bandwidth: str | None = None
        replication_timeout: float | None = None
        replication_streams: int | None = None
        failure_domain: str | None = None
        replicas: int | None = None

        def __post_init__(self) -> None:
            CheckpointManager.Config.__post_init__(self)  # slots dataclass: no zero-argument super()
            flat = {name: getattr(self, name) for name in DEPRECATED_KEYWORDS
                    if getattr(self, name) is not None}
            self.replication = Options.of("MemoryCheckpointManager.Config",
                                          replication=self.replication, deprecated=flat,
                                          stacklevel=4).replication
            for name in flat:
                setattr(self, name, None)  # now in self.replication
            if self.persistent_interval < 0 or self.persistent_interval % self.interval:
                raise ConfigError(
                    f"checkpoint.persistent_interval={self.persistent_interval} must be 0 or a "
                    f"multiple of checkpoint.interval={self.interval} (the dataloader snapshots "
                    "its state every interval steps)")

    def __init__(self, config: Config, **components: Any) -> None:
        super().__init__(config, **components)
        if not self.enable:
            return
        self.persistent_interval = config.persistent_interval
        self.last_resume: ResumeInfo | None = None  # what the start loaded (None: not from us)
        if self.persistent_interval == 0 and not self.load_only:
            log.warning("mlcheckpoint: checkpoint.persistent_interval=0: only memory holds the "
                        "periodic checkpoints; losing a node and its partner loses them")
        self.checkpoints = MemoryCheckpoints(
            TorchtitanFolder(self), job_id=config.job_id, local_dir=config.local_dir,
            keep=config.keep, keep_persistent=keep_persistent(config),
            memory_limit_bytes=config.memory_limit, replication=config.replication)

    # ------------------------------------------------------------------ save
    def _memory_due(self, curr_step: int) -> bool:
        # Step 0 is create_seed_checkpoint's model-only save: torchtitan's folder only.
        return curr_step > 0 and not self.load_only and curr_step % self.interval == 0

    def _persistent_due(self, curr_step: int, last_step: bool) -> bool:
        if self.load_only:
            return False
        if last_step or (curr_step == 1 and self.enable_first_step_checkpoint):
            return True
        return self.persistent_interval > 0 and curr_step % self.persistent_interval == 0

    def _should_save(self, curr_step: int, last_step: bool = False) -> bool:
        return self.enable and (self._memory_due(curr_step) or self._persistent_due(curr_step, last_step))

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        if self._memory_due(curr_step):
            try:
                # Returns once the state is copied to tmpfs: training may change it right after.
                # A save that fails (e.g. CapacityError) fails its future on every rank, and
                # the save thread logs it: training and the folder's saves go on.
                self.checkpoints.async_save(self._flattened_model_states_sd(), curr_step)
            except MLCheckpointError as e:  # (e.g. a manager closed): the folder still gets its saves
                log.error("mlcheckpoint: in-memory checkpoint of step %d failed: %s", curr_step, e)
            self._log_stats(curr_step)
        if self._persistent_due(curr_step, last_step):
            super()._save(curr_step, last_step)  # torchtitan's own, into its folder
        return True

    def _purge_stale_checkpoints(self) -> None:
        # torchtitan calls this after each save to its folder (rank 0 purges). Its own purge
        # counts every step-N folder, a write still in flight too, and could remove the last
        # complete one; mlcheckpoint's keeps the newest complete steps.
        if hasattr(self, "checkpoints"):
            self.checkpoints.prune_persistent(later=True)

    # ------------------------------------------------------------------ load
    def _load(self, step: int = -1) -> bool:
        if step != -1:
            # checkpoint.load_step names a step of the folder: torchtitan loads it; steps the
            # memory holds past it belong to the abandoned run.
            loaded = super()._load(step)
            self.checkpoints.continue_from(step)
            return loaded
        states = self._states_to_load(model_only=False)  # honours exclude_from_loading
        info = self.last_resume = self.checkpoints.resume(states)
        if info.step is None:
            # Nothing in memory or in the folder past step 0: torchtitan's own start.
            return super()._load(step)
        if info.source != "persistent":  # torchtitan's dcp_load did this for the folder
            self.states[MODEL].load_state_dict(states)
        self._log_stats(info.step)
        return True

    def _log_stats(self, step: int) -> None:
        """Our figures (``CheckpointManager.stats()``: the last save, the replication lag, the
        resume) into the trainer's own metric loggers (TensorBoard, W&B), beside its loss.
        torchtitan hands its Trainer to the checkpointer as the "train_state" entry."""
        trainer = self.states.get("train_state")
        metric_logger = getattr(getattr(trainer, "metrics_processor", None), "logger", None)
        if metric_logger is not None:
            metric_logger.log(self.checkpoints.stats(), step)

    # ------------------------------------------------------------------ close
    def _close(self) -> None:
        super()._close()
        if hasattr(self, "checkpoints"):
            self.checkpoints.close()  # non-collective when called while an error is handled

    def __del__(self) -> None:
        # Garbage collection is no place for collectives: release this rank's part only.
        if getattr(self, "enable", False) and hasattr(self, "checkpoints"):
            self.checkpoints.close(failed=True)
        super().__del__()

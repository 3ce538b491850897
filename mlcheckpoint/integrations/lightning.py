"""A Lightning ``ModelParallelStrategy`` (FSDP2) whose checkpoints go to memory, with
Lightning's own sharded checkpoints in its folder as the fallback.

    from mlcheckpoint.integrations.lightning import LATEST, MemoryCheckpoint, MLCheckpointStrategy

    trainer = L.Trainer(
        strategy=MLCheckpointStrategy(),                      # FSDP2, as ModelParallelStrategy
        callbacks=[MemoryCheckpoint(every_n_train_steps=10),  # to memory and the partner node
                   ModelCheckpoint(dirpath="ckpts", every_n_train_steps=500)])  # the fallback
    trainer.fit(model, ckpt_path=LATEST)  # newest of memory and ckpts/, or a fresh start

- ``save_checkpoint`` of a ``mlcheckpoint://`` path (what ``MemoryCheckpoint`` asks for) saves the
  model, optimizer states and Lightning's metadata (loops, callbacks, global step, schedulers)
  to memory; any other path is Lightning's own sharded checkpoint, written by Lightning.
- ``load_checkpoint(LATEST)`` loads, once, the newest of: a step in memory (local or on the
  partner node) and the newest sharded checkpoint in the fallback folder (by its global step);
  with neither, training starts fresh. A real path is loaded by Lightning, as usual.

Not covered: ``FSDPStrategy`` (FSDP1). It refuses CPU, keeps its own checkpoint formats
(full and sharded state dict types) and loads through FSDP1's state-dict contexts; use FSDP2 via
``ModelParallelStrategy``, the path Lightning itself recommends for new code.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.pytorch import __version__ as lightning_version
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from ..errors import ConfigError, CorruptShardError
from ..manager import CheckpointManager
from ..persistent import PersistentStorage
from ..recovery import ResumeInfo
from ..settings import DEPRECATED_KEYWORDS, Options, ReplicationOptions, default

SCHEME = "mlcheckpoint://"
LATEST = SCHEME + "latest"
_META = "lightning"  # Lightning's metadata, pickled: the same on every rank, like its meta.pt
log = logging.getLogger(__name__)
# What a resume restored, on rank 0: through Lightning's own console output (its logger has a
# handler of its own when the user configured none), beside "Restored all states ...".
_console = logging.getLogger("lightning.pytorch")


def memory_path(step: int) -> str:
    """The path ``trainer.save_checkpoint`` takes to save ``step`` to memory."""
    return f"{SCHEME}step-{step}"


def is_memory_path(path: Any) -> bool:
    return str(path).startswith(SCHEME)


class MemoryCheckpoint(Callback):
    """Saves to memory every ``every_n_train_steps`` optimizer steps (``trainer.save_checkpoint``
    of a memory path, so the checkpoint holds what Lightning's own would). List it after the
    callbacks whose state it should capture; Lightning runs ``ModelCheckpoint`` last."""

    def __init__(self, every_n_train_steps: int):
        if every_n_train_steps < 1:
            raise ConfigError(f"every_n_train_steps={every_n_train_steps} must be >= 1")
        self.every_n_train_steps = every_n_train_steps
        self._last_saved: int | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        if not isinstance(trainer.strategy, MLCheckpointStrategy):
            raise TypeError("MemoryCheckpoint needs Trainer(strategy=MLCheckpointStrategy(...)); "
                            f"{type(trainer.strategy).__name__} would write mlcheckpoint:// paths "
                            "to disk")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if (step == 0 or step % self.every_n_train_steps or step == self._last_saved
                or trainer.sanity_checking):
            return  # with gradient accumulation a step spans several batches
        self._last_saved = step
        # weights_only given: left None, Lightning logs a line per rank at every save.
        trainer.save_checkpoint(memory_path(step), weights_only=False)


class _ModelState(Stateful):
    """The sharded model state dict, read and applied only if ``dcp.load`` runs."""

    def __init__(self, model: torch.nn.Module, strict: bool):
        self.model, self.strict = model, strict

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict, options=StateDictOptions(strict=self.strict))


class _OptimizerState(Stateful):
    """An optimizer's sharded state, as Lightning saves it. Read only if ``dcp.load`` runs:
    reading it creates the optimizer's state, which a fresh start must not."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, optim_state_dict=state_dict,
                                 options=StateDictOptions(cpu_offload=True))


class LightningFolder(PersistentStorage):
    """Lightning's checkpoint folder (a ``ModelCheckpoint`` dirpath) as the persistent tier: a
    step is a sharded checkpoint there (DCP files and ``meta.pt``), numbered by its global
    step, and Lightning's own loader reads it.

    A preemption flush writes the step memory holds as one more such checkpoint,
    ``preempted-step=<S>.ckpt``: memory holds Lightning's sharded layout (``state_dict``,
    ``optimizer_<i>``) beside the metadata Lightning puts in ``meta.pt``, which becomes that
    file (``flush_files``). Lightning's own loader reads it, as ``fit(ckpt_path=...)``."""

    flushable = True

    def __init__(self, folder: str | os.PathLike, strategy: MLCheckpointStrategy):
        super().__init__(folder)
        self.strategy = strategy

    def flush_path(self, step: int) -> str:
        return os.path.join(self.location, f"preempted-step={step}.ckpt")

    def flush_files(self, read_item: Callable[[str], bytes]) -> dict[str, bytes]:
        meta = torch.load(io.BytesIO(read_item(_META)), weights_only=True)  # DCP's wrapping
        if not isinstance(meta, bytes):
            raise CorruptShardError(f"item {_META!r} holds a {type(meta).__name__}, not bytes")
        return {_METADATA_FILENAME: meta}

    def _checkpoints(self) -> dict[int, Path]:
        found: dict[int, Path] = {}
        root = Path(self.location)
        for path in sorted(root.iterdir()) if root.is_dir() else []:
            meta = path / _METADATA_FILENAME
            if not (meta.is_file() and (path / ".metadata").is_file()):
                continue  # not a sharded checkpoint, or one still being written
            # The job's own folder, which Lightning loads the same way.
            found.setdefault(int(torch.load(meta, weights_only=False)["global_step"]), path)
        return found

    def complete_steps(self) -> list[int]:
        return sorted(self._checkpoints())

    def path(self, step: int) -> str:
        return str(self._checkpoints()[step])

    def restore(self, state_dict: dict[str, Any], step: int, load: Any) -> None:
        path = self.path(step)
        log.info("mlcheckpoint: loading step %d from Lightning's folder: %s", step, path)
        state_dict[_META] = self.strategy._load_own(path)


def keep_persistent(callback: Any) -> int | None:
    """What a ``ModelCheckpoint`` keeps as ``keep_persistent``: its ``save_top_k`` when it
    keeps the newest checkpoints (no ``monitor``: Lightning allows only 1 then), else None
    (all: -1, or the best by a metric, which is not ours to choose)."""
    top_k = getattr(callback, "save_top_k", -1)
    if getattr(callback, "monitor", None) is None and isinstance(top_k, int) and top_k >= 1:
        return top_k
    return None


class MLCheckpointStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` (FSDP2) that saves ``mlcheckpoint://`` paths to memory.

    Args:
        folder: Lightning's checkpoint folder to fall back on (default: the dirpath of the
            trainer's first ``ModelCheckpoint``); None and no ModelCheckpoint: memory only.
        job_id, local_dir, keep, replication, memory_limit: as ``CheckpointManager``
            (``replication`` a ``ReplicationOptions`` or its mode; ``memory_limit`` is its
            ``memory_limit_bytes``). The flat ``replication_*``, ``failure_domain`` and
            ``replicas`` of earlier releases still work, with a DeprecationWarning.
        keep_persistent: complete checkpoints kept in the folder, pruned after each of
            Lightning's saves there (never the newest complete one). Default: the first
            ``ModelCheckpoint``'s ``save_top_k`` when it keeps the newest (no ``monitor``,
            ``save_top_k`` 1), else all.
        **kwargs: passed to ``ModelParallelStrategy``.
    """

    def __init__(self, *, folder: str | None = None, job_id: str | None = None,
                 local_dir: str | None = None, keep: int = default("keep"),
                 keep_persistent: int | None = None,
                 replication: ReplicationOptions | str | None = None,
                 memory_limit: str | int | None = None, **kwargs: Any):
        flat = {name: kwargs.pop(name) for name in DEPRECATED_KEYWORDS if name in kwargs}
        super().__init__(**kwargs)
        self._folder = folder
        self._options = Options.of("MLCheckpointStrategy", job_id=job_id, local_dir=local_dir,
                                   keep=keep, keep_persistent=keep_persistent,
                                   memory_limit_bytes=memory_limit, replication=replication,
                                   deprecated=flat)
        self.checkpoints: CheckpointManager | None = None
        self.last_resume: ResumeInfo | None = None  # that of the last load_checkpoint(LATEST)
        self._failed = False

    def setup(self, trainer) -> None:
        super().setup(trainer)
        self._check_mesh()
        if self.checkpoints is None:
            folder = self._folder or getattr(trainer.checkpoint_callback, "dirpath", None)
            options = self._options
            if options.keep_persistent is None:
                options = dataclasses.replace(
                    options, keep_persistent=keep_persistent(trainer.checkpoint_callback))
            self.checkpoints = CheckpointManager(
                LightningFolder(folder, self) if folder else None, options=options)

    # ------------------------------------------------------------------ save
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any | None = None) -> None:
        if not is_memory_path(filepath):
            super().save_checkpoint(checkpoint, filepath, storage_options)
            if self.checkpoints is not None:
                self.checkpoints.prune_persistent()  # rank 0, now that this save is complete
            return
        assert self.checkpoints is not None, "save_checkpoint before setup"
        state = {"state_dict": checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        state[_META] = _pickle(checkpoint)
        step = int(checkpoint["global_step"])
        self.checkpoints.async_save(state, step)
        self._log_stats(step)

    # ------------------------------------------------------------------ load
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        assert self.checkpoints is not None, "load_checkpoint before setup"
        module, model = self.lightning_module, self.model
        assert module is not None, "load_checkpoint before setup"
        if not is_memory_path(checkpoint_path):
            metadata = self._load_own(checkpoint_path, weights_only)
            if module.trainer.state.fn == TrainerFn.FITTING:
                # Training goes on from the named checkpoint: memory past it is abandoned.
                self.checkpoints.continue_from(int(metadata.get("global_step", 0)))
            return metadata
        assert model is not None, "load_checkpoint before setup"
        state: dict[str, Any] = {"state_dict": _ModelState(model, module.strict_loading)}
        state.update({f"optimizer_{i}": _OptimizerState(model, opt)
                      for i, opt in enumerate(self.optimizers)})
        state[_META] = b""
        info = self.last_resume = self.checkpoints.resume(state, announce=False)
        if self.global_rank == 0:  # one line per launch, in Lightning's console
            _console.log(logging.WARNING if info.fell_back else logging.INFO,
                         "mlcheckpoint: %s", info.summary)
        if info.step is None:
            return self._fresh_start()
        self._log_stats(info.step)
        meta = state[_META]
        return _unpickle(meta) if isinstance(meta, bytes) else meta

    def _load_own(self, path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's own load of a checkpoint in its folder."""
        return super().load_checkpoint(path, weights_only=weights_only)

    def _fresh_start(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        # Nothing was restored: the trainer has no checkpoint path, and Lightning does not
        # report "Restored all states from the checkpoint at mlcheckpoint://latest".
        self.lightning_module.trainer.ckpt_path = None
        return _NothingRestored({"pytorch-lightning_version": lightning_version})

    def _check_mesh(self) -> None:
        """Say so when no parameter spans more than one rank of a multi-rank job: the ranks
        then train alone, each on its own batches (``ModelParallelStrategy`` syncs nothing
        itself). Lightning's defaults on one node give data-parallel size 1 and tensor-parallel
        size = the processes, so a ``configure_model`` that shards over
        ``device_mesh["data_parallel"]`` does exactly that."""
        if self.world_size <= 1 or self.model is None:
            return
        if any(isinstance(p, DTensor) and p.device_mesh.size() > 1 for p in self.model.parameters()):
            return
        rank_zero_warn(
            f"MLCheckpointStrategy: the device mesh is data_parallel={self._data_parallel_size} x "
            f"tensor_parallel={self._tensor_parallel_size} and no parameter of the model is "
            f"sharded or replicated over more than one rank: each of the {self.world_size} ranks "
            "trains alone. If configure_model shards over device_mesh['data_parallel'], pass "
            f"MLCheckpointStrategy(data_parallel_size={self.world_size}, tensor_parallel_size=1).")

    def _log_stats(self, step: int) -> None:
        """Our figures (``CheckpointManager.stats()``: the last save, the replication lag, the
        resume) into the trainer's loggers (TensorBoard, W&B, CSV), beside the loss."""
        module = self.lightning_module
        if module is None or self.checkpoints is None:
            return
        loggers = module.trainer.loggers
        if loggers:
            figures = self.checkpoints.stats()
            for logger in loggers:
                logger.log_metrics(figures, step=step)

    # ------------------------------------------------------------------ lifecycle
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True
        super().on_exception(exception)

    def teardown(self) -> None:
        if self.checkpoints is not None:
            # After an exception, non-collective: the other ranks may never get here.
            self.checkpoints.close(failed=self._failed or None)
            self.checkpoints = None
        super().teardown()


class _NothingRestored(dict):
    """A fresh start's answer to Lightning's loader: it reads the version key before anything
    else, then restores nothing (no ``on_load_checkpoint`` hook, no loop or scheduler state)
    from a checkpoint that is empty. Plain Lightning calls no hook when nothing is loaded."""

    def __bool__(self) -> bool:
        return False


def _pickle(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpickle(data: bytes) -> Any:
    # Our own bytes: checksummed in tmpfs, authenticated on the wire.
    return torch.load(io.BytesIO(data), weights_only=False)

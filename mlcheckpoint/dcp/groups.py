"""Which process group ``dcp.async_save`` runs a save's collectives on, and the one it must not.

In THREAD mode DCP runs the save (plans gathered and scattered, results gathered, the
metadata broadcast) on a thread of its own, over the ``process_group`` the caller passed,
by default the default group. The training thread keeps issuing its own collectives
(FSDP's all-gathers, DDP's all-reduces, a loss reduced for logging) meanwhile, and
with gloo two threads that issue collectives on one group pair them up in different orders
on different ranks: gloo aborts the process ("op.preamble.length <= op.nbytes ... collective
mismatch") or both sides wait forever. The same holds for two async saves in flight on one
group (e.g. a FileSystemWriter's every N steps beside the in-memory one every step).

The manager's writers therefore refuse to be driven by a THREAD-mode ``dcp.async_save`` on
the default group, in ``stage``: on the training thread, inside the ``dcp.async_save`` call
and before DCP issues any collective, so every rank raises the same error and none is left
waiting. PROCESS mode runs the save in DCP's checkpoint process, on a group of its own, and a
blocking ``dcp.save`` runs on the caller's thread: both are safe on any group.

DCP hands a stager no process group, so ``async_save_call`` reads the arguments of the
``dcp.async_save`` frame that called ``stage`` (torch 2.13); where it finds none (a
direct ``stage()`` call, another torch), nothing is checked.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch.distributed as dist

from ..errors import ConfigError

_SAVER_MODULE = "torch.distributed.checkpoint.state_dict_saver"
_MAX_DEPTH = 12  # frames between dcp.async_save and stage(): DCP's loggers and ours


@dataclass(frozen=True)
class AsyncSaveCall:
    """What a ``dcp.async_save`` call was asked: its group (None: the default), whether it
    runs in DCP's checkpoint process, and ``no_dist``."""

    process_group: Any
    in_process_mode: bool
    no_dist: bool


def async_save_call() -> AsyncSaveCall | None:
    """The arguments of the ``dcp.async_save`` call the caller runs inside, or None."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(_MAX_DEPTH):
        if frame is None:
            return None
        if frame.f_code.co_name == "async_save" and frame.f_globals.get("__name__") == _SAVER_MODULE:
            args = frame.f_locals
            kind = args.get("async_checkpointer_type")
            return AsyncSaveCall(args.get("process_group"),
                                 getattr(kind, "value", kind) == "process",
                                 bool(args.get("no_dist")))
        frame = frame.f_back
    return None


def on_default_group(call: AsyncSaveCall) -> bool:
    """Whether ``call`` runs its collectives on the default group from DCP's thread, with
    other ranks to pair them with."""
    if call.in_process_mode or call.no_dist or not (dist.is_available() and dist.is_initialized()):
        return False
    default = dist.distributed_c10d._get_default_group()
    group = call.process_group
    return (group is None or group is default) and dist.get_world_size() > 1


def refuse_default_group(step: int) -> None:
    """Raise ConfigError if the ``dcp.async_save`` that is staging ``step`` runs on the
    default group in THREAD mode (see the module docstring)."""
    call = async_save_call()
    if call is not None and on_default_group(call):
        raise ConfigError(
            f"dcp.async_save of step {step} with ckpt.storage_writer() would run the save's "
            "collectives on the default process group, from DCP's background thread, while "
            "the training thread (and any other save in flight) uses that group: gloo then "
            "fails with 'collective mismatch' or hangs. Pass "
            "process_group=ckpt.process_group (a group only these saves use), and give every "
            "other dcp.async_save in flight at the same time a group of its own "
            "(docs/integration.md, \"DCP-native saves\")")

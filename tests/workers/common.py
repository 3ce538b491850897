"""Shared helpers for worker scripts launched by torchrun in tests."""

import json
import logging
import os
import sys

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from mlcheckpoint.testing.cluster import write_result

# TEST_NO_LOGGING_SETUP=1: a worker that, like many training scripts, never sets logging up.
if not os.environ.get("TEST_NO_LOGGING_SETUP"):
    logging.basicConfig(level=logging.INFO, format="%(asctime)s r%(process)d %(name)s %(levelname)s %(message)s")


def run_specs(run_job) -> None:
    """Run each job spec of ``sys.argv[1]`` (a JSON list) in turn as ``run_job(spec, rank,
    world, mesh)``, on one process group and a 1-D CPU device mesh."""
    rank, world = init()
    mesh = init_device_mesh("cpu", (world,))
    for spec in json.loads(sys.argv[1]):
        run_job(spec, rank, world, mesh)
    dist.destroy_process_group()


def init() -> tuple[int, int]:
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def report(name: str, data: dict) -> None:
    write_result(name, dist.get_rank() if dist.is_initialized() else 0, data)

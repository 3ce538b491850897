"""torchtitan 0.3.0's checkpointer with float8 training as its Float8LinearConverter sets it
up (torchao's Float8Linear layers; ``emulate`` on CPU). The same job as
test_integration_torchtitan.py (2 simulated nodes, memory every 2 steps, torchtitan's
folder every 4, saved until step 7, trained on to step 10); node 1 is then replaced by an
empty machine and the restart resumes step 6 from node 0's replicas and ends bit for bit
where the uninterrupted run did.

(With FSDP's float8 all-gather the weights become DTensors of torchao's
WeightWithDynamicFloat8CastTensor; torchtitan 0.3.0's own ModelWrapper.state_dict fails on
them, before any checkpoint writer runs. mlcheckpoint's side of that configuration is
tests/jobs/test_subclass_fsdp.py.)
"""

import os
import sys

import pytest
from cluster import Cluster
from helpers import from_another_node
from test_integration_torchtitan import (
    SAVED_UNTIL,
    STEPS,
    _assert_same_run,
    torchtitan_0_3_0,
)

pytestmark = pytest.mark.slow


def test_float8_fsdp_weights_resume_from_the_partner_bit_exact():
    """torchtitan's float8 FSDP weights (tensor subclasses) resume from the partner after a
    node is wiped, with the same losses as the uninterrupted run."""
    pytest.importorskip("torchao", reason="float8 training needs torchao (scripts/setup.sh --test)")
    torchtitan_dir = torchtitan_0_3_0()
    on_path = torchtitan_dir in sys.path
    path = os.pathsep.join(p for p in (None if on_path else torchtitan_dir,
                                       os.environ.get("PYTHONPATH")) if p)
    env = {"TITAN_FLOAT8": "1", "PYTHONPATH": path}
    with Cluster(2) as cluster:
        dump = os.path.join(cluster.root, "dump")
        cluster.run("titan_train.py", dump, STEPS, SAVED_UNTIL, env={**env, "TITAN_TAG": "ref"})
        ref = cluster.results("titan_ref")
        assert "FSDPFloat8Linear" in ref[0]["layers"], ref[0]["layers"]  # fully_shard renames it
        cluster.nodes[1].wipe()
        cluster.run("titan_train.py", dump, STEPS, env={**env, "TITAN_TAG": "peer", "TITAN_SEED": "1"})
        _assert_same_run(cluster, "peer", ref, 6, "peer")
        resume = cluster.results("titan_peer")[0]["resume"]
        assert from_another_node(resume["sources"], [1]), resume

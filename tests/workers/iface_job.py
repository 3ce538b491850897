"""Worker: build a CheckpointManager with the replication settings given in argv[1] (a JSON
object: "kwargs" for its ReplicationOptions, "save": whether to save step 0 and wait until it is on
two nodes), and report where replication listens, or the ConfigError the constructor raised.

report "iface": {"address", "interface", "chosen_by", "protected"} or {"error"}
"""

import json
import sys

import torch.distributed as dist
from common import init, report
from states import make_state

from mlcheckpoint import CheckpointManager, ConfigError, ReplicationOptions
from mlcheckpoint.testing import internals


def main() -> None:
    cfg = json.loads(sys.argv[1])
    rank, _world = init()
    try:
        ckpt = CheckpointManager(replication=ReplicationOptions(**cfg["kwargs"]))
    except ConfigError as e:
        report("iface", {"error": str(e)})
        dist.destroy_process_group()
        return
    replicator = internals(ckpt).replicator
    transport = replicator.transport if replicator else None
    endpoint = getattr(transport, "endpoint", None)
    protected = None
    if cfg.get("save"):
        ckpt.save(make_state(0, rank), 0)
        protected = ckpt.wait_replicated(0, timeout=60)
    report("iface", {"address": getattr(transport, "address", None),
                     "interface": endpoint and endpoint.interface,
                     "chosen_by": endpoint and endpoint.chosen_by, "protected": protected})
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

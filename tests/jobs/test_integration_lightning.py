"""Lightning 2.6: MLCheckpointStrategy (FSDP2, 2 CPU processes). A Trainer checkpoints to memory
and to Lightning's folder every 2 steps and is SIGKILLed after step 7. Resumed through the
strategy (fit(ckpt_path=LATEST)), it continues from step 6 in memory; with memory wiped, from
Lightning's own sharded step 6 in its folder; either way exactly as Lightning's own sharded
resume of step 6 does: the same loop position, losses, parameters and optimizer state."""

import os

import pytest
import torch

pytest.importorskip("mlcheckpoint.integrations.lightning",
                    reason="needs the [lightning] extra (scripts/setup.sh installs it)")

from cluster import Cluster

from mlcheckpoint.integrations.lightning import LATEST

pytestmark = pytest.mark.slow


def _run(cluster: Cluster, phase: str, folder: str, tag: str | None = None) -> int:
    cluster.start("lightning_train.py", phase, folder, env={"LIGHTNING_TAG": tag or phase})
    return cluster.wait(timeout=120)[0]


def test_lightning_strategy_resumes_from_memory_and_folder_like_lightning():
    with Cluster(1, nproc=2) as cluster:
        folder = os.path.join(cluster.root, "ckpts")
        assert _run(cluster, "save", folder) != 0  # killed after step 7
        assert "step=6.ckpt" in os.listdir(folder)  # Lightning's own, written by Lightning
        for phase in ("resume", "lightning"):
            assert _run(cluster, phase, folder) == 0, cluster.logs()
        assert f"Restored all states from the checkpoint at {LATEST}" in cluster.nodes[0].log()
        cluster.nodes[0].wipe()  # memory lost: Lightning's folder is all that is left
        assert _run(cluster, "resume", folder, tag="fallback") == 0, cluster.logs()

        own = cluster.results("lightning_lightning")
        expected = torch.load(os.path.join(cluster.out_dir, "lightning_lightning.pt"))
        for tag, source in (("resume", "local"), ("fallback", "persistent")):
            resumed = cluster.results(f"lightning_{tag}")
            assert sorted(resumed) == [0, 1], cluster.logs()
            for rank in (0, 1):
                logged = resumed[rank].pop("metrics")
                own[rank].pop("metrics", None)
                if tag == "resume":  # our figures reach Lightning's loggers, beside the loss
                    assert logged["6"]["mlcheckpoint/resume_step"] == 6, logged
                    assert logged["6"]["mlcheckpoint/resume_load_seconds"] > 0, logged
                    assert logged["10"]["mlcheckpoint/save_step"] in (8.0, 10.0), logged
                    assert logged["10"]["mlcheckpoint/save_bytes"] > 0, logged
                assert own[rank]["start"] == [6, 0] and own[rank]["global_step"] == 10
                assert resumed[rank]["source"] == source
                del resumed[rank]["source"], own[rank]["source"]
                assert resumed[rank] == own[rank]  # loop position, global step, every loss
                own[rank]["source"] = None
            final = torch.load(os.path.join(cluster.out_dir, f"lightning_{tag}.pt"))
            assert expected.keys() == final.keys() and any(k.startswith("optim.") for k in final)
            assert not [k for k in expected if not torch.equal(expected[k], final[k])], tag


def test_a_fresh_start_trains_as_lightning_alone_and_claims_no_restore():
    """fit(ckpt_path=LATEST) with nothing in memory or the folder trains exactly as Lightning's
    own strategy without a checkpoint (losses, parameters, optimizer state), and Lightning does
    not report "Restored all states from the checkpoint at mlcheckpoint://latest"."""
    with Cluster(1, nproc=2) as cluster:
        folder = os.path.join(cluster.root, "ckpts")
        assert _run(cluster, "fresh", folder) == 0, cluster.logs()
        printed = cluster.nodes[0].log().rsplit("\n===== ", 1)[-1]  # this launch's part
        assert _run(cluster, "plain", folder) == 0, cluster.logs()
        assert "Restored all states" not in printed, printed
        assert (f"Nothing to restore from {LATEST}: memory holds no checkpoint of this job and "
                "there is no persistent checkpoint: starting fresh") in printed, printed

        fresh, plain = cluster.results("lightning_fresh"), cluster.results("lightning_plain")
        assert sorted(fresh) == sorted(plain) == [0, 1], cluster.logs()
        for rank in (0, 1):
            for result in (fresh[rank], plain[rank]):
                result.pop("metrics")
            assert fresh[rank].pop("source") is None and plain[rank].pop("source") is None
            assert fresh[rank]["start"] == [0, 0] and fresh[rank]["global_step"] == 10
            assert fresh[rank] == plain[rank]  # every loss, bit for bit (JSON keeps a float's repr)
        ours = torch.load(os.path.join(cluster.out_dir, "lightning_fresh.pt"))
        alone = torch.load(os.path.join(cluster.out_dir, "lightning_plain.pt"))
        assert ours.keys() == alone.keys() and any(k.startswith("optim.") for k in ours)
        assert not [k for k in ours if not torch.equal(ours[k], alone[k])]

"""Lightning + FSDP2 with checkpoints in memory and Lightning's own folder as the fallback.

    pip install 'mlcheckpoint[lightning]'
    MLCHECKPOINT_JOB_ID=demo torchrun --nproc-per-node=2 examples/lightning_fsdp2.py --steps 40
    # stop it (Ctrl-C, or kill a rank) and run the same command again: it resumes from memory

Runs on CPU (gloo). Every 5 steps the training state goes to tmpfs (and, on several nodes, to
the partner node); every 20 steps Lightning writes its sharded checkpoint into ./lightning-ckpts.
A restart resumes from whichever is newer. See docs/integration.md.
"""

import argparse
import os

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from mlcheckpoint.integrations.lightning import (
    LATEST,
    MemoryCheckpoint,
    MLCheckpointStrategy,
)


class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                                 nn.Linear(64, 8))

    def configure_model(self):
        # FSDP2: shard every layer, then the root, over the data-parallel ranks.
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(4096, 32, generator=g)
        return DataLoader(TensorDataset(x, x[:, :8].sin()), batch_size=32, shuffle=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--folder", default="lightning-ckpts")
    args = parser.parse_args()
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # what torchrun started
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, num_nodes=int(os.environ.get("WORLD_SIZE", "1")) // devices,
        max_steps=args.steps, logger=False,
        strategy=MLCheckpointStrategy(data_parallel_size=int(os.environ.get("WORLD_SIZE", "1")),
                                      tensor_parallel_size=1),
        callbacks=[MemoryCheckpoint(every_n_train_steps=5),
                   ModelCheckpoint(dirpath=args.folder, every_n_train_steps=20, save_top_k=-1)])
    trainer.fit(Regressor(), ckpt_path=LATEST)
    info = trainer.strategy.last_resume
    if trainer.global_rank == 0 and info is not None:
        print("fresh start" if info.step is None else f"resumed step {info.step} from {info.source}")


if __name__ == "__main__":
    main()

"""Lightning + FSDP2 with checkpoints in memory and Lightning's own folder as the fallback.

    pip install 'mlcheckpoint[lightning]'
    MLCHECKPOINT_JOB_ID=demo torchrun --nproc-per-node=2 examples/lightning_fsdp2.py --steps 40
    # stop it (Ctrl-C, or kill a rank) and run the same command again: it resumes from memory

Runs on CPU (gloo) where there is no GPU. Every 5 steps the training state goes to tmpfs (and, on several nodes, to
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
    model = Regressor()
    # docs/integration.md's snippet, as written (a test checks that they agree)
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # the processes torchrun started here
    world = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = L.Trainer(
        devices=devices, num_nodes=world // devices, max_steps=args.steps,
        # FSDP2 over every rank: Lightning's defaults would make the data-parallel size the node
        # count (1 on one node), and a model sharded over device_mesh["data_parallel"] would then
        # train alone on each rank (the strategy warns at setup)
        strategy=MLCheckpointStrategy(data_parallel_size=world, tensor_parallel_size=1),
        callbacks=[MemoryCheckpoint(every_n_train_steps=5),     # memory + partner node
                   ModelCheckpoint(dirpath=args.folder, every_n_train_steps=20, save_top_k=-1)],
    )
    trainer.fit(model, ckpt_path=LATEST)   # resume from the newest of memory and the folder, else fresh
    # On rank 0 the strategy printed what was restored (trainer.strategy.last_resume.summary).


if __name__ == "__main__":
    main()

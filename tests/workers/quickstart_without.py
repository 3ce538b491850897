"""Worker: examples/quickstart.py without mlcheckpoint, the program its user had before adopting
it: the quickstart's own model, optimizer and training step in a plain loop, with nothing that
reads or writes a state dict. Rank 0 prints each step's loss as the quickstart does."""

import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
from quickstart import make_model, total_steps, train_step


def main() -> None:
    dist.init_process_group("gloo")
    model, optimizer = make_model()
    for step in range(total_steps):
        loss = train_step(model, optimizer, step)
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss}")
    dist.destroy_process_group()
    # Leave without freeing the DDP model: with torch 2.13 and gloo that can deadlock right
    # after a last allreduce (its reducer drops the group's last reference and joins gloo's
    # threads holding the GIL, while one of them waits for the GIL to free that allreduce; seen
    # in gdb, in about one run of six here). In the quickstart, close() comes in between.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

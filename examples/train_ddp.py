"""Data-parallel training of a persistrnn model with torch.distributed.

Runs unchanged on one GPU, several GPUs or several nodes:

    torchrun --nproc_per_node 1 examples/train_ddp.py
    torchrun --nproc_per_node 2 examples/train_ddp.py
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv-endpoint HOST:PORT examples/train_ddp.py

Each rank trains `DistributedDataParallel` over a 2-layer `persistrnn.LSTM`
and a linear head on its share of every global batch (NCCL when every rank
has a GPU of its own, gloo when ranks share one). At the end rank 0 trains
the same model from the same initialisation on the whole global batches in
one process and prints, as one JSON line, the largest relative difference
between the two runs' parameters: DDP averages the ranks' gradients, so the
runs agree to fp32 rounding.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import persistrnn

INPUT, HIDDEN, LAYERS, CLASSES, STEPS_PER_SEQUENCE = 32, 64, 2, 5, 20
GLOBAL_BATCH, TRAINING_STEPS, LEARNING_RATE = 8, 5, 0.1


class Tagger(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = persistrnn.LSTM(INPUT, HIDDEN, LAYERS)
        self.rnn.training_kernels = True  # persistrnn's training operators (else torch's implementation trains)
        self.head = torch.nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])


def global_batches(device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same data on every rank: (x (T, B, I), labels (T, B)) per step."""
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(STEPS_PER_SEQUENCE, GLOBAL_BATCH, INPUT, generator=gen).to(device),
             torch.randint(0, CLASSES, (STEPS_PER_SEQUENCE, GLOBAL_BATCH), generator=gen).to(device))
            for _ in range(TRAINING_STEPS)]


def train(model: torch.nn.Module, batches: list, columns: slice) -> None:
    optimiser = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    for x, labels in batches:
        optimiser.zero_grad(set_to_none=True)
        logits = model(x[:, columns])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, CLASSES), labels[:, columns].reshape(-1))
        loss.backward()
        optimiser.step()


def main() -> None:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    if GLOBAL_BATCH % world:
        raise SystemExit(f"the global batch ({GLOBAL_BATCH}) must divide over the {world} ranks")
    own_gpu = torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    device = torch.device("cuda", local if own_gpu else 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl" if own_gpu else "gloo")
    torch.manual_seed(1)
    initial = Tagger().to(device)
    batches = global_batches(device)
    share = GLOBAL_BATCH // world
    ddp = DistributedDataParallel(Tagger().to(device), device_ids=[device.index])
    ddp.module.load_state_dict(initial.state_dict())
    train(ddp, batches, slice(rank * share, (rank + 1) * share))
    if rank == 0:
        train(initial, batches, slice(None))  # one process, the whole global batches
        worst = max(float((a - b).norm() / b.norm()) for a, b in
                    zip(ddp.module.parameters(), initial.parameters()))
        print(json.dumps({"world_size": world, "backend": dist.get_backend(), "steps": TRAINING_STEPS,
                          "global_batch": GLOBAL_BATCH, "largest_relative_difference": worst}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

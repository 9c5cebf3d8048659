"""The baseline: a plain torch DDP training script, as a user would write it for torchrun.

Same model (gradmesh's plain GPT), same corpus, same global batch, AdamW and gradient
clipping; no gradmesh code in the loop. Writes one wall-clock timestamp per optimizer step
to --out (rank 0) so the benchmark can compare steady-state throughput.

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/plain_ddp.py --out t.json
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from gradmesh.data.corpus import char_datasets, load_text
from gradmesh.models.gpt import GPT, GPTConfig


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    train, _, vocab = char_datasets(load_text("", 3_000_000), args.block_size, 0.1)
    torch.manual_seed(0)
    model = DistributedDataParallel(GPT(GPTConfig(vocab_size=len(vocab.chars), block_size=args.block_size,
                                                  n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(0))
    per_rank = args.global_batch_size // world
    stamps = []
    for step in range(args.steps):
        start = step * args.global_batch_size + rank * per_rank
        inputs, targets = train.__getitems__(order[start : start + per_rank].tolist())
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        stamps.append(time.time())
    if rank == 0:
        with open(args.out, "w") as handle:
            json.dump({"time": stamps}, handle)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

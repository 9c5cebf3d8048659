"""plain_ddp.py's training, written with gradmesh's own-loop API (`gradmesh.Loop`): the same GPT,
corpus, global batch, AdamW and clip; gradmesh's sampler, weighting, services and metrics.jsonl
(whose per-step stamps bench_ddp.py reads).

    gradmesh run --nproc 2 benchmarks/own_loop_gpt.py --run-dir runs/own-gpt
"""

import argparse

import torch
import torch.nn.functional as F

import gradmesh
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
    parser.add_argument("--run-dir", required=True)
    args = parser.parse_args()

    gm = gradmesh.Loop(run_dir=args.run_dir, seed=0, grad_clip=1.0, quiet=True)
    train, _, vocab = char_datasets(load_text("", 3_000_000), args.block_size, 0.1)
    model = GPT(GPTConfig(vocab_size=len(vocab.chars), block_size=args.block_size,
                          n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd))
    model, optimizer = gm.prepare(model, torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0))
    for _step, (inputs, targets) in gm.batches(train, args.global_batch_size, args.steps):
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        gm.backward(loss)
        gm.step(optimizer)
    gm.close()


if __name__ == "__main__":
    main()

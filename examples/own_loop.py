"""Your own training loop, distributed: gradmesh.Loop around a plain PyTorch loop (an MLP).

    gradmesh run --nproc 2 examples/own_loop.py --run-dir runs/own       # 2 workers
    torchrun --nproc-per-node 2 examples/own_loop.py --run-dir runs/own  # the same under torchrun
    python examples/own_loop.py --run-dir runs/own-1                     # one process

The loop is yours: the forward, the loss (a plain mean over the batch), what you log. gradmesh
gives each rank its share of every global batch (in the same global order at any world size),
weights the backward so that N ranks train the model one process trains, clips, steps, writes
metrics.jsonl, checkpoints and model.safetensors, and resumes (--resume).
"""

import argparse

import torch
import torch.nn as nn

import gradmesh


class Regression(torch.utils.data.Dataset):
    """Noisy samples of a fixed linear map."""

    def __init__(self, count: int = 1000, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(count, 8, generator=generator)
        true_map = torch.randn(8, 2, generator=generator)
        self.y = self.x @ true_map + 0.1 * torch.randn(count, 2, generator=generator)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        return self.x[index], self.y[index]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="runs/own")
    parser.add_argument("--strategy", default="ddp", help="ddp, zero1, fsdp or tp")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--global-batch-size", type=int, default=64)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--resume", action="store_true", help="go on from the run directory's latest checkpoint")
    args = parser.parse_args()

    gm = gradmesh.Loop(strategy=args.strategy, run_dir=args.run_dir, seed=0, grad_accum=args.grad_accum,
                       grad_clip=1.0, checkpoint_every=args.checkpoint_every, resume=args.resume)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2))
    decay = [p for p in model.parameters() if p.dim() > 1]
    rest = [p for p in model.parameters() if p.dim() <= 1]
    if args.optimizer == "sgd":
        optimizer = torch.optim.SGD([{"params": decay, "weight_decay": 1e-4}, {"params": rest}], lr=0.05, momentum=0.9)
    else:
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
                                      lr=0.01)
    model, optimizer = gm.prepare(model, optimizer)
    for _step, (inputs, targets) in gm.batches(Regression(args.samples), args.global_batch_size, args.steps):
        loss = ((model(inputs) - targets) ** 2).mean()
        gm.backward(loss)
        gm.step(optimizer)
        gm.log(batch_mean_target=targets.mean())
    summary = gm.close()
    if gm.rank == 0:
        print(f"final loss {summary['final_loss']:.5f} after {summary['samples']} samples")


if __name__ == "__main__":
    main()

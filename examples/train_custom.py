"""Bring your own model, loss and dataset: a single-process script made distributed.

    gradmesh run --nproc 2 examples/train_custom.py --run-dir runs/custom
    python examples/train_custom.py --run-dir runs/custom-1     # the same code on one process

The data: noisy samples of a fixed linear map; the model: a two-layer MLP regressor. Nothing in
the model or the dataset knows about distribution; gradmesh.init() joins the job that
`gradmesh run` (or torchrun) started, and the Trainer splits every global batch across ranks.
"""

import argparse

import torch
import torch.nn as nn

import gradmesh


class Regression(torch.utils.data.Dataset):
    def __init__(self, count: int = 1000, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(count, 8, generator=generator)
        true_map = torch.randn(8, 2, generator=generator)
        self.y = self.x @ true_map + 0.1 * torch.randn(count, 2, generator=generator)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        return self.x[index], self.y[index]


def per_sample_loss(model: nn.Module, batch) -> torch.Tensor:
    """One loss per sample (reduction='none'): gradmesh weights them exactly across ranks."""
    inputs, targets = batch
    return ((model(inputs) - targets) ** 2).mean(dim=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="runs/custom")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--global-batch-size", type=int, default=64)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    parser.add_argument("--strategy", default="ddp", help="ddp, zero1, fsdp or ps (the last rank a parameter server)")
    args = parser.parse_args()

    session = gradmesh.init()                      # 1. join the job (or be rank 0 of 1)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2))
    trainer = gradmesh.Trainer(                    # 2. hand over model, loss and data
        session, model, per_sample_loss, Regression(args.samples),
        train=gradmesh.TrainConfig(global_batch_size=args.global_batch_size, grad_accum=args.grad_accum,
                                   max_steps=args.steps, decay_steps=args.steps, warmup_steps=0,
                                   lr=0.01, optimizer=args.optimizer, strategy=args.strategy),
        run_dir=args.run_dir, ps=gradmesh.PSConfig(servers=1),
    )
    summary = trainer.fit()                        # 3. train: metrics, checkpoints, weights
    trainer.print_summary()
    if session.rank == 0:
        print(f"final loss {summary['final_loss']:.5f} after {summary['samples']} samples")
    session.close()


if __name__ == "__main__":
    main()

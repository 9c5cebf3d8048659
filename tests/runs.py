"""The training runs several test modules share through the session's catalogue.

Arguments that do not change the trained weights or the sample order (checkpoint cadence,
sample records, replica checks) are the same in every module that asks for a run, so that the
same normalised arguments — one run — serve parity, resume, fault, monitoring and layout tests.
"""

from pathlib import Path

import shutil

from catalogue import Catalogue, copy_run
from helpers import weights

# Contract 2's yardstick: 20 optimizer steps of 16 samples.
STEPS = ("--max-steps", "20", "--global-batch-size", "16")

# Read by resume (pruning), fault (exactly-once records) and monitoring (replica checks) tests;
# none of it changes the weights, so parity tests read the same runs.
RECORDED = ("--checkpoint-every", "5", "--set", "checkpoint.keep=2", "--record-samples", "--check-every", "5")

# Pipeline and tensor-parallel runs need 4 layers (4 pipeline stages) and 4 heads (tp=4).
WIDE = ("--set", "model.n_layer=4", "--set", "model.n_head=4")

# Checkpoints at steps 10 and 20, both kept: a resharding test resumes a copy from step 10 (`at_step_10`)
# instead of training a run of its own that stops there.
TENS = ("--checkpoint-every", "10", "--set", "checkpoint.keep=0")

# A run stopped at step 10 with every checkpoint kept (step-5, step-10), for resume tests to copy.
HALF = ("--max-steps", "10", "--global-batch-size", "16", "--optimizer", "adamw", "--strategy", "ddp",
        "--checkpoint-every", "5", "--set", "checkpoint.keep=0")

# mlp-digits: 1437 training samples, 96 per step: step 15 holds 93 samples, step 16 starts epoch 1.
DIGITS = ("--model", "mlp-digits", "--max-steps", "20", "--global-batch-size", "96", "--optimizer", "sgd",
          "--record-samples")

# Load balancing's reaction run (test_balance; the dashboard plots its shares): rank 1 slowed 3x
# for steps 1-10 of 30 under SGD, with --compression auto and --bucket-mb auto on board.
BALANCED = ("--max-steps", "30", "--global-batch-size", "16", "--optimizer", "sgd", "--balance", "auto",
            "--inject", "slow:rank=1,factor=3,delay=0.01,step=1,steps=10", "--compression", "auto", "--bucket-mb", "auto")


def ddp_run(catalogue: Catalogue, nproc: int, optimizer: str) -> Path:
    """Data parallel (world size 1: the single-process reference) for 20 steps, with RECORDED."""
    return catalogue.run(nproc, *STEPS, "--optimizer", optimizer, *RECORDED)


def sharded_run(catalogue: Catalogue, nproc: int, optimizer: str, strategy: str) -> Path:
    """zero1 or fsdp for 20 steps, with TENS (resharding tests resume copies from step 10)."""
    return catalogue.run(nproc, *STEPS, "--optimizer", optimizer, "--strategy", strategy, *TENS)


def wide_run(catalogue: Catalogue, nproc: int, optimizer: str, *layout: str) -> Path:
    """The 4-layer, 4-head model for 20 steps (with TENS); no layout: the single-process reference."""
    return catalogue.run(nproc, *WIDE, *STEPS, "--optimizer", optimizer, *TENS, *layout)


def at_step_10(run_dir: Path, to: Path) -> Path:
    """A copy of a 20-step run with TENS that a --resume continues from step 10."""
    copy = copy_run(run_dir, to)
    shutil.rmtree(copy / "checkpoints" / "step-20")
    return copy


def half_run(catalogue: Catalogue, nproc: int, strategy: str = "ddp") -> Path:
    return catalogue.run(nproc, *HALF, "--strategy", strategy)


def digits_run(catalogue: Catalogue, nproc: int, *extra: str) -> Path:
    return catalogue.run(nproc, *DIGITS, *extra, tiny=False)


class References(dict):
    """optimizer -> final weights of a single-process reference run, trained on first use (a
    fast-tier selection that needs only the sgd reference does not train the adamw one)."""

    def __init__(self, reference_run):
        super().__init__()
        self._reference_run = reference_run

    def __missing__(self, optimizer: str):
        self[optimizer] = weights(self._reference_run(optimizer))
        return self[optimizer]

"""A synthetic click log for the recsys workload: made at run time, deterministic, no download.

Each sample has DENSE standard-normal features and one id per categorical feature (one
embedding table each), drawn from a Zipf distribution over the table's rows (P(k-th most
popular) ∝ k^-s; a fixed permutation scatters the popular ids over the table, as hashing ids
into rows does), and a click drawn from a hidden ground-truth model:

    logit = BASE + w·dense + Σ_t a_t[id_t] + Σ_{t<u} c_t[id_t]·c_u[id_u]

with w, a_t and c_t fixed random values. A dot-product interaction model (DLRM) can represent
it. Every held-out sample's true click probability is known, so the Bayes-optimal AUC (ranking
by the true probability) and log loss (the labels' entropy under it) are the ceilings a model
can reach; they are computed on the held-out split itself.

The log is generated from its own seed, not the training seed: every rank, run and strategy
sees the same samples, and only the order in which they are drawn follows the training seed.
"""

import math
from dataclasses import dataclass

import torch

DENSE = 13
"""Dense features per sample (Criteo's click logs have 13)."""
BASE = -1.2
"""The truth's intercept: about a 25% click rate."""
SEED = 20_240_601


@dataclass(frozen=True)
class ClickSpec:
    rows: tuple[int, ...]
    """Rows of each table (one table per categorical feature)."""
    samples: int
    """Samples in the whole log (training and held out)."""
    zipf: float = 1.1
    eval_fraction: float = 0.1


class ClickLog(torch.utils.data.Dataset):
    """(dense [n, DENSE] float32, ids [n, tables] int64, clicks [n] float32), with a batched fetch."""

    def __init__(self, dense: torch.Tensor, ids: torch.Tensor, clicks: torch.Tensor, truth: torch.Tensor):
        self.dense, self.ids, self.clicks = dense, ids, clicks
        self.truth = truth
        """The true click probability of each sample (what a perfect model would predict)."""

    def __len__(self) -> int:
        return len(self.clicks)

    def __getitem__(self, index: int):
        return self.dense[index], self.ids[index], self.clicks[index]

    def __getitems__(self, indices: list[int]):
        index = torch.tensor(indices, dtype=torch.long)
        return self.dense[index], self.ids[index], self.clicks[index]


POPULAR = 32
"""The truth's id effects fade with popularity rank k as 1 / (1 + k / POPULAR): the long tail of
rarely seen ids carries little signal (as in real logs, where it is mostly noise), so a model
that learns the popular ids can come close to the ceiling."""


def _zipf_ranks(rows: int, count: int, exponent: float, generator: torch.Generator) -> torch.Tensor:
    """`count` popularity ranks (0 = most popular) of a table of `rows` rows, Zipf-distributed."""
    weights = torch.arange(1, rows + 1, dtype=torch.float64).pow(-exponent)
    cdf = weights.cumsum(0)
    cdf /= cdf[-1].clone()
    return torch.searchsorted(cdf, torch.rand(count, dtype=torch.float64, generator=generator)).clamp_(max=rows - 1)


def generate(spec: ClickSpec) -> tuple[ClickLog, ClickLog]:
    """(training split, held-out split) of the click log `spec` describes."""
    generator = torch.Generator().manual_seed(SEED)
    tables, n = len(spec.rows), spec.samples
    dense = torch.randn(n, DENSE, generator=generator)
    ranks = torch.stack([_zipf_ranks(rows, n, spec.zipf, generator) for rows in spec.rows], dim=1)
    logit = BASE + dense @ (torch.randn(DENSE, generator=generator) / math.sqrt(DENSE))
    pairs = tables * (tables - 1) / 2
    interaction, side = torch.zeros(n), torch.zeros(n)
    ids = torch.empty_like(ranks)
    for t, rows in enumerate(spec.rows):
        # Per-rank truth drawn table by table (memory: a few floats per row of one table at a time).
        # (in place: every rank makes the log, and a table of 10^7 rows is 40 MB per float array)
        fade = torch.arange(rows, dtype=torch.float32).div_(POPULAR).add_(1.0).reciprocal_()
        own = torch.randn(rows, generator=generator).mul_(fade).mul_(2.0 / math.sqrt(tables))
        logit += own[ranks[:, t]]
        del own
        shared = torch.randn(rows, generator=generator).mul_(fade).mul_(2.0 / pairs**0.25)
        del fade
        term = shared[ranks[:, t]]
        del shared
        interaction += side * term  # Σ_{u<t} c_u c_t, accumulated as Σ_t c_t (Σ_{u<t} c_u)
        side += term
        ids[:, t] = torch.randperm(rows, generator=generator)[ranks[:, t]]  # popular ids scattered over the table
    truth = torch.sigmoid(logit + interaction)
    clicks = torch.bernoulli(truth, generator=generator)
    cut = n - max(1, int(n * spec.eval_fraction))

    def split(part):
        return ClickLog(
            dense[part].contiguous(), ids[part].contiguous(), clicks[part].contiguous(), truth[part].contiguous()
        )

    return split(slice(0, cut)), split(slice(cut, n))

"""The peer side of the recsys benchmark: gradmesh's DLRM workload trained by TorchRec's
DistributedModelParallel (DMP), as a TorchRec user would write it for torchrun.

    benchmarks/peers/.venvs/torchrec/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        benchmarks/peers/torchrec_dlrm.py --rows 100000 --sharding table --steps 200 --out t.json

Run with OMP_NUM_THREADS=1 (one thread per process, as gradmesh gives each of 2 workers on 2
cores); gloo backend, CPU. benchmarks/peers/bench_recsys.py runs it, in the peer venv it makes.

The same work as `gradmesh train --model recsys --set model.rows=N --global-batch-size 512`:
  - the same click log: gradmesh.data.clicks.generate of the spec gradmesh.workloads.click_spec
    builds from gradmesh's own config defaults with model.rows=N (8 tables, 3 x 10^6 samples,
    Zipf 1.1); the repository root is put on sys.path so gradmesh's config, data and model
    modules import here (they need torch and tomli-w only);
  - the same samples in the same order: gradmesh's GlobalOrderSampler (train.seed), each rank
    taking its contiguous half of every global batch of 512;
  - the same model: the 8 tables (rows split as gradmesh splits them, dim 16) as one TorchRec
    EmbeddingBagCollection, one id per feature, sum pooling (a bag of one id is the row itself),
    sharded by the plan --sharding picks (table-wise or row-wise); the bottom MLP, the pairwise
    dot interaction and the top MLP are gradmesh's DLRM's own modules (DMP wraps them in DDP).
    torch is seeded with train.seed before the model is built, as gradmesh's session does, and
    the tables' rows are then overwritten with the DLRM's `init_rows` (N(0, 0.05^2), seeded by
    block), so both sides start from the same weights;
  - the same optimizers: tables by TorchRec's fused row-wise Adagrad (FBGEMM's
    EXACT_ROWWISE_ADAGRAD, eps 1e-8, no weight decay) at train.table_lr; dense layers by AdamW
    at train.lr (train.weight_decay); both on gradmesh's warm-up + cosine schedule (lr_factor).

What differs, by TorchRec's design:
  - gradient clipping: the fused optimizer updates the tables inside the backward pass, so
    their gradients never exist as tensors and cannot enter a global norm. The dense gradients
    alone are clipped to train.grad_clip (1.0); gradmesh clips the norm of all gradients,
    the tables' included.
  - gradient scale of the tables: each rank's loss is the mean over its own samples (TorchRec's
    convention); DDP averages the dense gradients over the ranks (the global mean, as gradmesh),
    while the tables' gradients arriving from the ranks are summed (2x the global mean).
    Row-wise Adagrad divides by the root of the accumulated squares, so the update is the same
    up to eps.
  - row-wise sharding on CPU: TorchRec's EmbeddingBagCollectionSharder offers ROW_WISE only for
    CUDA; `CpuRowWiseSharder` below adds it to the CPU list (the kernels and collectives it
    needs run on CPU/gloo).

Checked by hand (not a test): on both plans the sharded model's logits equal those of
gradmesh's DLRM built the same way, to the bit; after 60 steps at 10^5 and 10^6 rows the last
loss and the held-out AUC agree with gradmesh ddp, hybrid and tables to about 1e-7. The AUC is
computed here (`auc`, equal to scikit-learn's roc_auc_score, ties included), so the peer venv
needs no scikit-learn.

Writes (rank 0) --out JSON: "time" (wall-clock stamp after each step, once its loss is read),
"loss" (the last step's training loss, the global mean), "eval" (held-out loss and AUC over
the whole held-out split, as gradmesh's end-of-run eval), the plan and the versions.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from fbgemm_gpu.split_embedding_configs import EmbOptimType  # noqa: E402
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder  # noqa: E402
from torchrec.distributed.model_parallel import DistributedModelParallel  # noqa: E402
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology  # noqa: E402
from torchrec.distributed.types import ShardingType  # noqa: E402
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType  # noqa: E402
from torchrec.modules.embedding_modules import EmbeddingBagCollection  # noqa: E402
from torchrec.optim.optimizers import in_backward_optimizer_filter  # noqa: E402
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: E402

from gradmesh.config import build as build_config  # noqa: E402
from gradmesh.data.clicks import DENSE, generate  # noqa: E402
from gradmesh.data.sampler import GlobalOrderSampler, split_evenly  # noqa: E402
from gradmesh.models.dlrm import DLRM, sample_losses  # noqa: E402
from gradmesh.workloads import click_spec  # noqa: E402

EVAL_BATCH = 4096
"""Held-out samples per forward at the end (gradmesh: max(global batch, 4096))."""


class CpuRowWiseSharder(EmbeddingBagCollectionSharder):
    """TorchRec's sharder, with row-wise sharding allowed on CPU (upstream lists it for CUDA only)."""

    def sharding_types(self, compute_device_type: str) -> list[str]:
        types = super().sharding_types(compute_device_type)
        if ShardingType.ROW_WISE.value not in types:
            types.append(ShardingType.ROW_WISE.value)
        return types


class TorchRecDLRM(nn.Module):
    """gradmesh's DLRM with its tables as one EmbeddingBagCollection (what DMP shards)."""

    def __init__(self, sparse: EmbeddingBagCollection, dlrm: DLRM, tables: int):
        super().__init__()
        self.sparse = sparse
        self.bottom, self.top = dlrm.bottom, dlrm.top
        self.pairs = dlrm.pairs  # a plain tensor, as in DLRM (not a buffer: DDP need not sync it)
        self.tables = tables

    def forward(self, dense: torch.Tensor, ids: KeyedJaggedTensor) -> torch.Tensor:
        bottom = self.bottom(dense)
        # by name, as TorchRec's own DLRM (SparseArch) does: a table-wise plan returns the features
        # grouped by rank (f0, f2, ..., f1, f3, ...), not in the order of the keys given
        pooled = self.sparse(ids).to_dict()
        vectors = torch.stack([bottom] + [pooled[f"f{t}"] for t in range(self.tables)], dim=1)
        dots = vectors @ vectors.transpose(1, 2)
        left, right = self.pairs
        return self.top(torch.cat([bottom, dots[:, left, right]], dim=1)).sum(dim=-1)


def features(ids: torch.Tensor) -> KeyedJaggedTensor:
    """ids [batch, tables] -> one id per sample per feature, feature-major as a KJT wants."""
    batch, tables = ids.shape
    return KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{t}" for t in range(tables)],
        values=ids.t().contiguous().view(-1),
        lengths=torch.ones(batch * tables, dtype=torch.int32),
    )


def lr_factor(step: int, train) -> float:
    """gradmesh.engine.records.lr_factor (linear warm-up, then cosine to min_lr), restated here so
    the peer venv need not import gradmesh's engine."""
    import math

    if step < train.warmup_steps:
        return (step + 1) / train.warmup_steps
    progress = min(1.0, (step - train.warmup_steps) / max(1, train.decay_steps - train.warmup_steps))
    floor = train.min_lr / train.lr
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """ROC AUC (ties averaged, as scikit-learn's roc_auc_score): the Mann-Whitney U statistic."""
    order = scores.double().argsort()
    ranked, hits = scores.double()[order], labels[order] > 0.5
    _, inverse, counts = torch.unique_consecutive(ranked, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    mean_rank = ((ends - counts + 1 + ends) / 2)[inverse]
    positives = float(hits.sum())
    negatives = len(hits) - positives
    return float((mean_rank[hits].sum() - positives * (positives + 1) / 2) / (positives * negatives))


def load_initial_rows(model: DistributedModelParallel, dlrm: DLRM, tables: int) -> int:
    """Overwrite each local shard of every table with the DLRM's initial rows; returns rows written."""
    written = 0
    state = model.state_dict()
    for t in range(tables):
        weight = next(v for k, v in state.items() if k.endswith(f"embedding_bags.t{t}.weight"))
        for shard in weight.local_shards():
            (row, col), (count, width) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            with torch.no_grad():
                shard.tensor.copy_(dlrm.init_rows(t, row, row + count)[:, col : col + width])
            written += count
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000, help="rows of all tables together (model.rows)")
    parser.add_argument("--sharding", choices=("table", "row"), default="table")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--global-batch-size", type=int, default=512)
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="more gradmesh config values, as gradmesh's --set (e.g. model.samples=200000)")
    parser.add_argument("--no-eval", action="store_true", help="skip the held-out AUC at the end")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    layer: dict[str, dict] = {"model": {"name": "recsys", "rows": args.rows},
                              "train": {"global_batch_size": args.global_batch_size}}
    for item in args.set:
        key, value = item.split("=", 1)
        section, name = key.split(".", 1)
        layer.setdefault(section, {})[name] = value
    cfg = build_config([layer])  # coerces the --set strings as gradmesh's --set does
    spec = click_spec(cfg)
    train_split, held_out = generate(spec)
    torch.manual_seed(cfg.train.seed)  # as gradmesh's session, before the model is built
    dlrm = DLRM(spec.rows, cfg.model.dim, DENSE, cfg.model.hidden, materialize=False)
    tables = len(spec.rows)
    sparse = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=f"t{t}", embedding_dim=cfg.model.dim, num_embeddings=count,
                                   feature_names=[f"f{t}"], pooling=PoolingType.SUM)
                for t, count in enumerate(spec.rows)],
        device=torch.device("meta"),
    )
    sharder = CpuRowWiseSharder(fused_params={
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": cfg.train.table_lr, "eps": 1e-8,
    })
    kind = ShardingType.TABLE_WISE if args.sharding == "table" else ShardingType.ROW_WISE
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world, compute_device="cpu", local_world_size=world),
        constraints={f"t{t}": ParameterConstraints(sharding_types=[kind.value], compute_kernels=["fused"])
                     for t in range(tables)},
    )
    module = TorchRecDLRM(sparse, dlrm, tables)
    plan = planner.collective_plan(module, [sharder], dist.GroupMember.WORLD)
    model = DistributedModelParallel(module, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    initial_rows = load_initial_rows(model, dlrm, tables)

    dense_params = dict(in_backward_optimizer_filter(model.named_parameters()))
    dense_optimizer = torch.optim.AdamW(dense_params.values(), lr=cfg.train.lr,
                                        weight_decay=cfg.train.weight_decay)
    fused = model.fused_optimizer
    sampler = GlobalOrderSampler(len(train_split), cfg.train.global_batch_size, cfg.train.seed)
    stamps, losses = [], []
    for step in range(args.steps):
        factor = lr_factor(step, cfg.train)
        for group in dense_optimizer.param_groups:
            group["lr"] = cfg.train.lr * factor
        for group in fused.param_groups:
            group["lr"] = cfg.train.table_lr * factor
        fused.step()  # sets the rate the fused update inside the next backward uses
        share = split_evenly(sampler.next_global().indices, world)[rank]
        dense, ids, clicks = train_split.__getitems__(share)
        loss = sample_losses(model(dense, features(ids)), clicks).mean()
        loss.backward()
        if cfg.train.grad_clip:
            torch.nn.utils.clip_grad_norm_(dense_params.values(), cfg.train.grad_clip)
        dense_optimizer.step()
        dense_optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        stamps.append(time.time())

    # the last step's loss over the global batch; the initial rows every rank wrote (all of them, once)
    totals = torch.tensor([losses[-1] * len(share), float(initial_rows)], dtype=torch.float64)
    dist.all_reduce(totals)
    result = {"time": stamps, "loss": float(totals[0]) / cfg.train.global_batch_size, "steps": args.steps,
              "sharding": args.sharding, "world_size": world, "table_rows": list(spec.rows),
              "initial_rows_loaded": int(totals[1]), "threads": torch.get_num_threads(),
              "plan": str(plan), "versions": versions()}
    if not args.no_eval:
        result["eval"] = evaluate(model, held_out, rank, world)
    if rank == 0:
        Path(args.out).write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


@torch.no_grad()
def evaluate(model: DistributedModelParallel, held_out, rank: int, world: int) -> dict:
    """Held-out loss and AUC over the whole held-out split: each rank scores its half of every
    chunk (DMP's forward is collective), rank 0 gathers the logits."""
    model.eval()
    logits = []
    for start in range(0, len(held_out), EVAL_BATCH):
        chunk = list(range(start, min(start + EVAL_BATCH, len(held_out))))
        parts = split_evenly(chunk, world)
        dense, ids, _ = held_out.__getitems__(parts[rank])
        mine = model(dense, features(ids)).float()
        width = len(parts[0])
        padded = torch.zeros(width)
        padded[: len(mine)] = mine
        gathered = [torch.zeros(width) for _ in range(world)]
        dist.all_gather(gathered, padded)
        logits.extend(g[: len(p)] for g, p in zip(gathered, parts))
    scores = torch.cat(logits)
    model.train()
    return {"loss": float(sample_losses(scores, held_out.clicks).mean()),
            "auc": auc(torch.sigmoid(scores), held_out.clicks)}


def versions() -> dict:
    from importlib.metadata import version

    return {name: version(name) for name in ("torch", "torchrec", "fbgemm-gpu-cpu")}


if __name__ == "__main__":
    main()

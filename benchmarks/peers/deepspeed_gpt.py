"""DeepSpeed's side of the peers benchmark: benchmarks/plain_ddp.py's run through deepspeed.initialize.

Same model (gradmesh's plain GPT), same corpus and sample order, same global batch, AdamW
(lr 2e-3, no weight decay) and gradient clipping at 1.0 as the plain torch DDP script; the only
change is that DeepSpeed's engine owns the model and optimizer, at the ZeRO stage given by
--stage (fp32, no offload). Run by benchmarks/peers/bench_gpt.py with the DeepSpeed venv's
python; gradmesh is not installed there, its model and corpus are imported from this checkout.
Writes one wall-clock timestamp per optimizer step, the last step's loss (mean over the global
batch) and the DeepSpeed config to --out (rank 0).

    DS_ACCELERATOR=cpu benchmarks/peers/.venvs/deepspeed/bin/python -m torch.distributed.run \\
        --standalone --nproc-per-node 2 benchmarks/peers/deepspeed_gpt.py --stage 3 --out t.json
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # gradmesh's model and corpus, from this checkout
os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when deepspeed is first imported

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from gradmesh.data.corpus import char_datasets, load_text  # noqa: E402
from gradmesh.models.gpt import GPT, GPTConfig  # noqa: E402


def ds_config(stage: int, global_batch: int, per_rank: int, persistence_threshold: int) -> dict:
    """fp32 (neither fp16 nor bf16 set), no offload; everything else DeepSpeed's defaults, except
    at stage 3 the persistence threshold: by default parameters under 1e5 elements stay whole on
    every rank, which in this model is all of them, so ZeRO-3 would not shard at all. 0 shards
    every parameter, as gradmesh's fsdp (FSDP2) does."""
    zero: dict = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = persistence_threshold
    return {
        "train_batch_size": global_batch,
        "train_micro_batch_size_per_gpu": per_rank,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, choices=(0, 1, 2, 3), required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--persistence-threshold", type=int, default=0,
                        help="stage3_param_persistence_threshold (stage 3 only; DeepSpeed's default is 100000)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    train, _, vocab = char_datasets(load_text("", 3_000_000), args.block_size, 0.1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=len(vocab.chars), block_size=args.block_size,
                          n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd))
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    per_rank = args.global_batch_size // world
    config = ds_config(args.stage, args.global_batch_size, per_rank, args.persistence_threshold)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(0))
    stamps = []
    last = float("nan")
    for step in range(args.steps):
        start = step * args.global_batch_size + rank * per_rank
        inputs, targets = train.__getitems__(order[start : start + per_rank].tolist())
        logits = engine(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        engine.backward(loss)
        engine.step()  # gradient reduction (per the stage), clipping, AdamW, zero_grad
        last = loss.item()
        stamps.append(time.time())
    # The last step's loss over the whole global batch (each rank holds its half's mean), outside the timing.
    total = torch.tensor([last])
    dist.all_reduce(total)
    if rank == 0:
        with open(args.out, "w") as handle:
            json.dump({"time": stamps, "loss": total.item() / world, "stage": args.stage, "config": config,
                       "deepspeed": deepspeed.__version__, "torch": torch.__version__}, handle)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

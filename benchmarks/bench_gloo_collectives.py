"""Benchmark: what ZeRO-1's two designs cost in collectives on gloo, side by side.

    .venv/bin/python benchmarks/bench_gloo_collectives.py            # 2 workers, the GPT's gradient size

ZeRO-1 as torch's ZeroRedundancyOptimizer runs it here (gradmesh `zero1`): the gradient
all-reduced by DDP, then each rank's updated half broadcast (one flat bucket per rank). ZeRO-1
as DeepSpeed and the ZeRO paper describe it: the gradient reduce-scattered, the updated halves
all-gathered — the same bytes on a ring, half the memory traffic of the reduction. Which is
faster depends on the backend's implementations; this measures gloo's, rounds alternating, and
prints the median milliseconds per call and per design.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER = r'''
import json, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, n = dist.get_rank(), dist.get_world_size()
size, calls, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
size -= size % n
full, part = torch.randn(size), torch.empty(size // n)
ops = {
    "all_reduce": lambda: dist.all_reduce(full),
    "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, full),
    "all_gather": lambda: dist.all_gather_into_tensor(full, part),
    "broadcast_per_rank": lambda: [dist.broadcast(part, r) for r in range(n)],
}
times = {}
for name, op in ops.items():
    for _ in range(3):
        op()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        op()
    times[name] = (time.perf_counter() - start) / calls * 1e3
if rank == 0:
    json.dump(times, open(out, "w"))
dist.destroy_process_group()
'''


def one_round(nproc: int, size: int, calls: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        script, out = Path(tmp) / "worker.py", Path(tmp) / "times.json"
        script.write_text(WORKER)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               str(script), str(size), str(calls), str(out)]
        subprocess.run(cmd, check=True, env=env, capture_output=True)
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--elements", type=int, default=837_888, help="fp32 elements (default: the GPT of bench_ddp)")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "gloo-collectives.json"))
    args = parser.parse_args()
    rounds = []
    for index in range(args.rounds):
        print(f"round {index + 1}/{args.rounds}", flush=True)
        rounds.append(one_round(args.nproc, args.elements, args.calls))
        time.sleep(0.5)
    med = {name: statistics.median(r[name] for r in rounds) for name in rounds[0]}
    designs = {
        "all-reduce + broadcasts (gradmesh zero1)": med["all_reduce"] + med["broadcast_per_rank"],
        "reduce-scatter + all-gather": med["reduce_scatter"] + med["all_gather"],
    }
    result = {"nproc": args.nproc, "elements": args.elements, "calls": args.calls, "rounds": rounds,
              "median_ms": med, "designs_ms": designs, "cpu_count": os.cpu_count()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"{args.elements * 4 / 2**20:.1f} MiB fp32, {args.nproc} gloo workers, median ms per call over "
          f"{args.rounds} rounds of {args.calls} calls")
    for name, ms in {**med, **designs}.items():
        print(f"  {name:44s} {ms:7.2f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

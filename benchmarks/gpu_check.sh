#!/usr/bin/env bash
# The CUDA/NCCL checks, for a machine with a GPU (CI has none): the GPU-marked tests, one short run
# of each strategy that fits one GPU, the non-finite guard and the memory guard on CUDA, and a
# step-time comparison of gradmesh's DDP with and without the non-finite check. Writes logs to
# $OUT (or ./gpu-check). Uses the machine's own python3 and torch; packages gradmesh needs that
# are missing there can be given as wheels in .whl/ (installed into /tmp/site).
set -uo pipefail
OUT=${OUT:-gpu-check}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1
log() { echo "== $*" | tee -a "$OUT/summary.txt"; }
nvidia-smi -L | tee -a "$OUT/summary.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())" | tee -a "$OUT/summary.txt"

log "pytest tests/test_gpu.py"
timeout 240 python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider -rs 2>&1 | tail -15 | tee -a "$OUT/summary.txt"

TINY="--set model.n_layer=2 --set model.n_head=2 --set model.n_embd=64 --set model.block_size=64 --set data.max_chars=200000 --set train.eval_batches=1 --set train.sample_chars=0"
run() {  # name, expected exit code, args...
    local name=$1 expect=$2; shift 2
    local start=$SECONDS
    timeout 180 python3 -m gradmesh train --nproc 1 --device cuda --quiet --run-dir "/tmp/gm-$name" --overwrite "$@" \
        >"$OUT/$name.log" 2>&1
    local code=$?
    local verdict=ok; [ "$code" = "$expect" ] || verdict=FAILED
    log "$name: exit $code (expected $expect) $verdict in $((SECONDS - start)) s"
    [ "$verdict" = ok ] || tail -20 "$OUT/$name.log" | tee -a "$OUT/summary.txt"
}
for strategy in ddp zero1 fsdp tp; do
    run "strategy-$strategy" 0 $TINY --strategy "$strategy" --max-steps 30 --global-batch-size 16
done
run nonfinite-stop 4 --model mlp-digits --max-steps 12 --optimizer sgd --lr 1e30
run nonfinite-skip 0 $TINY --max-steps 12 --global-batch-size 16 --on-nonfinite skip --inject nan:rank=0,step=4
run nonfinite-rollback 0 $TINY --max-steps 12 --global-batch-size 16 --on-nonfinite rollback --checkpoint-every 3 --inject nan:rank=0,step=5
run balance-auto 0 $TINY --max-steps 20 --global-batch-size 16 --balance auto
grep -h '"kind": "nonfinite"' /tmp/gm-nonfinite-*/alerts.jsonl | cut -c1-300 | tee -a "$OUT/summary.txt"
python3 - <<'EOF' 2>&1 | tee -a "$OUT/summary.txt"
import json
for name in ("strategy-ddp", "strategy-fsdp", "nonfinite-skip", "nonfinite-rollback"):
    rows = [json.loads(line) for line in open(f"/tmp/gm-{name}/metrics.jsonl")]
    times = sorted(r["step_time_s"] for r in rows[3:])
    print(name, "median step", round(times[len(times) // 2] * 1000, 2), "ms", "last loss", rows[-1]["loss"],
          "skipped", [r["step"] for r in rows if r.get("skipped")])
EOF

log "step time, default model on one GPU: the non-finite check on and off"
python3 benchmarks/nonfinite_overhead.py --device cuda 2>&1 | tail -8 | tee -a "$OUT/summary.txt"

"""Contract 1: the sequence of global batches is independent of world size and micro-batching,
and every sample of an epoch is used exactly once — read from the per-rank sample records."""

import json
from collections import Counter

from runs import digits_run


def consumed(run_dir, nproc):
    """step -> indices consumed by all ranks together, ranks in order."""
    steps: dict[int, list[int]] = {}
    for rank in range(nproc):
        for line in (run_dir / f"samples-rank{rank}.jsonl").read_text().splitlines():
            record = json.loads(line)
            steps.setdefault(record["step"], []).extend(record["indices"])
    return steps


def test_global_batches_match_across_world_sizes_and_epoch_is_covered_once(catalogue):
    # The same runs as test_parity's short-last-batch test (the catalogue trains them once).
    one = consumed(digits_run(catalogue, 1), 1)
    four = consumed(digits_run(catalogue, 4, "--grad-accum", "2"), 4)
    assert one == four
    # 1437 training digits at 96 per step: steps 1-15 are epoch 0, the 15th holds 93 samples.
    epoch0 = Counter(i for step in range(1, 16) for i in one[step])
    assert len(one[15]) == 93
    assert set(epoch0.values()) == {1} and sorted(epoch0) == list(range(1437))
    assert len(set(one[16])) == 96  # epoch 1 begins with a fresh, full batch

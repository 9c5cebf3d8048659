"""Load balancing (issue 17): uneven shares train the single-process model, and `auto` moves
samples away from a slow rank and back once it recovers. The same run carries --compression
auto and --bucket-mb auto (issue 16), which must change nothing trained on loopback."""

import json

import pytest

from gradmesh.data.sampler import split_by
from helpers import metrics, rel_l2, weights

THIRTY = ("--max-steps", "30", "--global-batch-size", "16", "--optimizer", "sgd")


def test_shares_split_a_batch_in_order_by_proportion():
    parts = split_by(list(range(16)), (0.75, 0.25))
    assert parts == [list(range(12)), list(range(12, 16))]
    assert [len(p) for p in split_by(list(range(7)), (0.5, 0.3, 0.2))] == [4, 2, 1]  # largest remainders round up
    assert sum(split_by(list(range(5)), (0.9, 0.1)), []) == list(range(5))


@pytest.mark.slow  # two runs; the split itself stays in the fast tier
def test_auto_moves_samples_off_a_slow_rank_and_back_and_stays_exact(catalogue):
    """Rank 1 slowed 3x for steps 1-10 of 30, SGD (which shows a wrongly weighted sample, unlike
    AdamW): the shares re-split after steps 5 and 10 move towards rank 0 (uneven, and changing
    mid-run), and once the slow-down has ended they move back (a re-split under 2 points is
    skipped, so the test looks at the three chances after it); every rank switches at the same
    step, so the model is still one process's. (static:S1,... sets the same sampler field from
    the start; the suite's time budget keeps one run here.)"""
    run = catalogue.run(2, *THIRTY, "--balance", "auto", "--inject", "slow:rank=1,factor=3,step=1,steps=10",
                        "--compression", "auto", "--bucket-mb", "auto")  # the suite's budget: one run for all three
    rows = metrics(run)
    first = [row.get("shares", [0.5, 0.5])[0] for row in rows]
    assert first[:5] == [0.5] * 5 and first[5] > 0.5 and first[10] > first[5]  # towards the fast rank
    assert min(first[15:]) < first[10]  # back, once rank 1 is as fast again
    assert rel_l2(weights(run), weights(catalogue.run(1, *THIRTY))) <= 1e-5
    # --compression auto on loopback: the probe finds the all-reduce a small share of compute and
    # keeps none (so the model is still one process's); --bucket-mb auto re-wrapped DDP for its
    # one candidate (this model fits one 1 MiB bucket), timed over 2 steps, and recorded it.
    chosen = json.loads((run / "compression.json").read_text())
    assert chosen["choice"] == "none" and chosen["step"] == 2 and chosen["bandwidth_Bps"] > 0
    assert chosen["estimated_comm_s"] <= 0.1 * chosen["compute_s"]
    buckets = json.loads((run / "buckets.json").read_text())
    assert buckets["chosen_mb"] == 1.0 and [len(t) for t in buckets["step_s"].values()] == [2]
    alerts = (run / "alerts.jsonl").read_text()
    assert '"kind": "balance"' in alerts and "data-parallel rank 1 the slowest" in alerts

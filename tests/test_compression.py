"""Gradient compression (issue 16): fp16 and bf16 put half the bytes of every data-parallel
all-reduce on the wire and train nearly the model the fp32 all-reduce trains."""

import pytest

from helpers import metrics, rel_l2, weights
from runs import STEPS, ddp_run


@pytest.mark.parametrize("compression, tolerance", [("fp16", 1e-5), ("bf16", 1e-4)])  # measured 1.3e-6, 1.1e-5
def test_half_width_gradients_halve_the_bytes_and_stay_near_fp32(catalogue, compression, tolerance):
    """2 ranks, SGD (which, unlike AdamW, shows a gradient's error in the step): each rank hands
    2 bytes per parameter to the all-reduce every step (the fp32 run: 4), and after 20 steps the
    model is within the tolerance of the fp32 all-reduce's yet not identical to it (the gradients
    did travel rounded)."""
    run = catalogue.run(2, *STEPS, "--optimizer", "sgd", "--compression", compression)
    params = sum(t.numel() for t in weights(run).values())
    assert all(row["breakdown"]["comm_bytes"] == [2 * params] * 2 for row in metrics(run))
    distance = rel_l2(weights(run), weights(ddp_run(catalogue, 2, "sgd")))
    assert 0 < distance <= tolerance, distance

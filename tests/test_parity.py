"""Contract 2: N ranks train the same model as one process with the same global batch.

Tolerance: relative L2 over all parameters <= 1e-5 after 20 optimizer steps (DESIGN.md). One
wrong sample per step gives ~2.5e-3 and a 5% gradient-scale error under SGD ~4.5e-4, so the
bound separates summation-order noise from real mistakes.
"""

import pytest

from helpers import references, rel_l2, train, weights

TOLERANCE = 1e-5
STEPS = ["--max-steps", "20", "--global-batch-size", "16"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return references(tmp_path_factory, "ref", *STEPS)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("nproc", [2, 4])
def test_ddp_matches_single_process(reference, tmp_path, nproc, optimizer):
    train(tmp_path, nproc, *STEPS, "--optimizer", optimizer)
    assert rel_l2(weights(tmp_path), reference[optimizer]) <= TOLERANCE


def test_gradient_accumulation_matches_single_process(reference, tmp_path):
    train(tmp_path, 2, *STEPS, "--optimizer", "sgd", "--grad-accum", "4")
    assert rel_l2(weights(tmp_path), reference["sgd"]) <= TOLERANCE


def test_parity_check_detects_a_different_batch(reference, tmp_path):
    """The yardstick can fail: a different global batch is far outside the tolerance."""
    train(tmp_path, 2, "--max-steps", "20", "--global-batch-size", "14", "--optimizer", "sgd")
    assert rel_l2(weights(tmp_path), reference["sgd"]) > 10 * TOLERANCE


def test_short_last_batch_of_an_epoch_is_weighted_exactly(tmp_path):
    """mlp-digits: 1437 training samples, 96 per step, so step 15 holds 93 samples; 20 steps
    cross the epoch boundary. Every sample must count 1/93 there, on 1 and on 4 ranks."""
    args = ["--model", "mlp-digits", "--max-steps", "20", "--global-batch-size", "96", "--optimizer", "sgd"]
    train(tmp_path / "one", 1, *args, tiny=False)
    train(tmp_path / "four", 4, *args, tiny=False)
    assert rel_l2(weights(tmp_path / "four"), weights(tmp_path / "one")) <= TOLERANCE


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("strategy, nproc", [("zero1", 2), ("zero1", 4), ("fsdp", 2), ("fsdp", 4)])
def test_sharded_strategies_match_single_process(reference, tmp_path, strategy, nproc, optimizer):
    train(tmp_path, nproc, *STEPS, "--optimizer", optimizer, "--strategy", strategy)
    assert rel_l2(weights(tmp_path), reference[optimizer]) <= TOLERANCE


def test_fsdp_gradient_accumulation_matches_single_process(reference, tmp_path):
    train(tmp_path, 2, *STEPS, "--optimizer", "sgd", "--strategy", "fsdp", "--grad-accum", "2")
    assert rel_l2(weights(tmp_path), reference["sgd"]) <= TOLERANCE

"""`--strategy tables` (issue 28): the sparse tables split by rows over every rank, the lookups'
rows and their gradients exchanged by all-to-all, the dense network data parallel. Held to the
single-process model (tables included, a global clip that binds), to DCP resharding both ways
with ddp, to the bytes each rank holds, and to the same held-out AUC as data parallelism."""

import json

import pytest

from catalogue import copy_run
from gradmesh.fault import checkpoint
from helpers import metrics, python_m_gradmesh, rel_l2, summary, train, weights
from test_recsys import PARITY, SMALL

TABLES = ("--strategy", "tables")


def test_two_ranks_train_the_single_process_model_tables_included(catalogue):
    """grad_clip 0.02 binds (the clipped model is 19% away from the unclipped one): the tables'
    rows, summed on their owners, count in the global norm as one process's dense gradient does."""
    run, reference = catalogue.run(2, *PARITY, *TABLES, tiny=False), catalogue.run(1, *PARITY, tiny=False)
    assert rel_l2(weights(run), weights(reference)) <= 1e-5
    found, expected = summary(run)["eval"], summary(reference)["eval"]
    assert abs(found["auc"] - expected["auc"]) < 1e-4 and abs(found["loss"] - expected["loss"]) < 1e-4
    assert summary(run)["strategy"] == "tables"


def test_three_ranks_with_uneven_row_ranges_and_two_micro_batches_train_the_same_model(catalogue):
    """500 rows a table over 3 ranks (167, 167, 166), 252 samples a step over 3 ranks in 2
    micro-batches each: every rank's lookups go to every owner in unequal numbers."""
    batch = ("--global-batch-size", "252")
    run = catalogue.run(3, *PARITY, *batch, *TABLES, "--set", "train.grad_accum=2", tiny=False)
    assert rel_l2(weights(run), weights(catalogue.run(1, *PARITY, *batch, tiny=False))) <= 1e-5


def test_each_rank_holds_its_rows_of_the_tables_and_the_whole_dense_part(catalogue):
    """model_state_bytes, as each rank counts the tensors it holds after a step, is the formula:
    the dense parameters with their gradients and AdamW's two moments (16 bytes each), and this
    rank's rows of every table (4 x dim bytes) with one row-wise accumulator each (4 bytes), and
    a step count (4 bytes) per parameter tensor."""
    run = catalogue.run(2, *PARITY, *TABLES, tiny=False)
    found = weights(run)
    tables = [tuple(tensor.shape) for name, tensor in found.items() if name.startswith("tables.")]
    dense = sum(tensor.numel() for name, tensor in found.items() if not name.startswith("tables."))
    for rank in range(2):
        held = sum(min(-(-rows // 2), rows - rank * -(-rows // 2)) for rows, _ in tables)
        expected = 16 * dense + held * (4 * tables[0][1] + 4) + 4 * len(found)
        assert {row["model_state_bytes"][rank] for row in metrics(run)} == {expected}


@pytest.mark.slow  # fast-tier budget: the 2-rank checkpoint resumes below cover resharding
def test_a_tables_checkpoint_resumes_under_ddp_on_one_rank(catalogue, tmp_path):
    """The tables' row shards and their accumulators, saved by DCP under their parameter names,
    load whole into a single process that ends where the uninterrupted one does."""
    split = copy_run(catalogue.run(2, *PARITY, *TABLES, tiny=False), tmp_path / "split")
    checkpoint.checkpoint_root(split).joinpath("step-20").rename(split / "not-this-one")
    train(split, 1, "--resume", "--strategy", "ddp", "--max-steps", "20", tiny=False)
    assert rel_l2(weights(split), weights(catalogue.run(1, *PARITY, tiny=False))) <= 1e-5


def test_a_ddp_checkpoint_resumes_under_tables_and_back(catalogue, tmp_path):
    """One process's step-10 checkpoint (whole tables) resumed under tables at 2 ranks (each
    keeps its rows), and that run's own step-10 checkpoint resumed under ddp at 2 ranks: both
    end where one process does after 20 steps."""
    reference = catalogue.run(1, *PARITY, tiny=False)
    split = copy_run(reference, tmp_path / "split")
    checkpoint.checkpoint_root(split).joinpath("step-20").rename(split / "not-this-one")
    train(split, 2, "--resume", *TABLES, "--max-steps", "20", tiny=False)
    assert rel_l2(weights(split), weights(reference)) <= 1e-5
    back = copy_run(catalogue.run(2, *PARITY, *TABLES, tiny=False), tmp_path / "back")
    checkpoint.checkpoint_root(back).joinpath("step-20").rename(back / "not-this-one")
    train(back, 2, "--resume", "--strategy", "ddp", "--max-steps", "20", tiny=False)
    assert rel_l2(weights(back), weights(reference)) <= 1e-5


def test_tables_reach_the_auc_data_parallelism_reaches(catalogue):
    """350 steps of the small click log: the same held-out AUC as ddp's run (the same model, up
    to summation order), near the Bayes-optimal ceiling."""
    run, ddp = catalogue.run(2, *SMALL, *TABLES, tiny=False), catalogue.run(2, *SMALL, tiny=False)
    found, expected = summary(run)["eval"], summary(ddp)["eval"]
    assert abs(found["auc"] - expected["auc"]) < 1e-3
    assert found["auc_ceiling"] - 0.03 <= found["auc"] <= found["auc_ceiling"]


def test_a_model_without_sparse_tables_is_refused_before_launch(tmp_path):
    done = python_m_gradmesh("train", "--model", "mlp-digits", *TABLES, "--run-dir", str(tmp_path / "r"))
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--strategy tables" in lines[0] and "--model recsys" in lines[0]
    assert "Traceback" not in done.stderr and not (tmp_path / "r").exists()


def test_a_short_last_batch_that_gives_ranks_unequal_micro_batches_trains_the_same_model(catalogue):
    """1,803 training samples in batches of 20: the epoch's last batch has 3 samples, shares 2 and
    1, which two micro-batches cut into 2 and 1 forwards. Every forward is a collective here, so
    the second rank runs a padding micro-batch at weight 0 (without it the job hangs); the model
    after crossing into the next epoch is one process's."""
    args = ("--model", "recsys", "--set", "model.rows=4000", "--set", "model.samples=2003", "--max-steps", "92",
            "--global-batch-size", "20", "--set", "train.grad_accum=2")
    run = catalogue.run(2, *args, *TABLES, tiny=False)
    assert rel_l2(weights(run), weights(catalogue.run(1, *args, tiny=False))) <= 1e-5
    assert summary(run)["samples"] == 92 * 20 - (20 - 3)  # every sample of the short batch, once


def test_bucket_tuning_re_wraps_ddp_and_keeps_the_single_process_model(catalogue):
    """--bucket-mb auto wraps the module in DDP again for each trial size: the tables' weights
    must keep their rows and their optimizer (a `.to()` in the re-wrap once dropped the mark the
    optimizer finds them by, and the tables stopped training after step 1: AUC 0.66 against 0.78)."""
    run = catalogue.run(2, *PARITY, *TABLES, "--bucket-mb", "auto", tiny=False)
    assert json.loads((run / "buckets.json").read_text())["candidates_mb"]  # the trials ran
    assert rel_l2(weights(run), weights(catalogue.run(1, *PARITY, tiny=False))) <= 1e-5

"""`--strategy tables` (issue 28): the sparse tables split by rows over every rank (or, with
--table-sharding table, each whole on one rank), the lookups' rows and their gradients exchanged
by all-to-all, the dense network data parallel. Held to the
single-process model (tables included, a global clip that binds), to DCP resharding both ways
with ddp, to the bytes each rank holds, and to the same held-out AUC as data parallelism."""

import json

import pytest
import torch

from catalogue import copy_run
from gradmesh.comm.exchange import Link, Router
from gradmesh.fault import checkpoint
from gradmesh.parallel.placement import greedy_owners
from gradmesh.parallel.table_layout import row_layout, table_layout
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


# -- table-wise sharding (--table-sharding table): every table whole on one rank ------------------

TABLE_WISE = (*TABLES, "--table-sharding", "table")
UNEVEN = ("--global-batch-size", "252", "--set", "train.grad_accum=2")


def test_greedy_placement_puts_the_largest_table_first_on_the_least_loaded_rank():
    """Tables of 5, 9, 9, 2, 7 rows over 2 ranks, by hand: 9 (t1) -> 0; 9 (t2) -> 1; 7 (t4) ->
    0 (9 = 9, the lower rank); 5 (t0) -> 1 (16 > 9); 2 (t3) -> 1 (16 > 14): 16 rows each. A
    rank's tables sit one after another in table order, and a lookup's key is its row's place
    there (owner = base + id // chunk, key = start + id mod chunk, chunk = the table's rows)."""
    rows = [5, 9, 9, 2, 7]
    assert greedy_owners(rows, 2) == [1, 0, 1, 1, 0]
    assert greedy_owners(rows, 3) == [2, 0, 1, 0, 2]  # 9, 9, 7 on ranks 0-2; 5 to rank 2 (7), 2 to rank 0 (9 = 9)
    first, second = table_layout(rows, 2, 0), table_layout(rows, 2, 1)
    assert first.ranges == [(0, 0), (0, 9), (0, 0), (0, 0), (0, 7)] and first.held == 16
    assert second.starts == [0, 0, 5, 14, 9] and second.held == 16 and second.size == 16
    ids = torch.tensor([[4], [8], [0], [1], [6]])  # one lookup per table: the last row of t0, t1, t4
    owner, keys = Router(second.placement("cpu"), 2, Link(None, 1))._keys(ids)
    assert owner.tolist() == [1, 0, 1, 1, 0] and keys.tolist() == [4, 8, 5, 15, 15]
    even = row_layout(rows, 2, 1)  # chunks 3, 5, 5, 1, 4: rank 1 holds rows [c, 2c) of each
    assert even.ranges == [(3, 5), (5, 9), (5, 9), (1, 2), (4, 7)] and even.size == 5 * 5


@pytest.mark.slow
def test_two_ranks_table_wise_train_the_single_process_model_tables_included(catalogue):
    run, reference = catalogue.run(2, *PARITY, *TABLE_WISE, tiny=False), catalogue.run(1, *PARITY, tiny=False)
    assert rel_l2(weights(run), weights(reference)) <= 1e-5
    found, expected = summary(run)["eval"], summary(reference)["eval"]
    assert abs(found["auc"] - expected["auc"]) < 1e-4 and abs(found["loss"] - expected["loss"]) < 1e-4


@pytest.mark.slow
def test_three_ranks_table_wise_with_eight_tables_and_two_micro_batches_train_the_same_model(catalogue):
    """8 tables over 3 ranks: 3, 3 and 2 whole tables; every rank's lookups go to every owner."""
    run = catalogue.run(3, *PARITY, *UNEVEN, *TABLE_WISE, tiny=False)
    assert rel_l2(weights(run), weights(catalogue.run(1, *PARITY, *UNEVEN, tiny=False))) <= 1e-5


@pytest.mark.slow
def test_table_wise_each_rank_holds_its_own_tables_whole_and_no_rows_of_the_others(catalogue):
    """model_state_bytes as in the row-wise test, but the rows are whole tables: eight tables of
    500 rows placed greedily over 3 ranks (equal sizes: round robin) are 3, 3 and 2 tables."""
    run = catalogue.run(3, *PARITY, *UNEVEN, *TABLE_WISE, tiny=False)
    found = weights(run)
    dim = found["tables.0.weight"].shape[1]
    dense = sum(tensor.numel() for name, tensor in found.items() if not name.startswith("tables."))
    for rank, tables in enumerate((3, 3, 2)):
        expected = 16 * dense + tables * 500 * (4 * dim + 4) + 4 * len(found)
        assert {row["model_state_bytes"][rank] for row in metrics(run)} == {expected}


@pytest.mark.slow
def test_a_table_wise_checkpoint_resumes_under_ddp_and_row_wise_and_a_ddp_one_under_table_wise(catalogue, tmp_path):
    """The step-10 checkpoint of 2 ranks table-wise (each table and its accumulator saved as the
    row-wise DTensor) resumed under ddp on 1 rank and under row-wise tables on 2, and one
    process's step-10 checkpoint resumed table-wise on 2: each ends where one process does."""
    reference = catalogue.run(1, *PARITY, tiny=False)
    table_wise = catalogue.run(2, *PARITY, *TABLE_WISE, tiny=False)
    resumes = [(table_wise, 1, ("--strategy", "ddp")), (table_wise, 2, ("--table-sharding", "row")),
               (reference, 2, TABLE_WISE)]
    for number, (source, nproc, args) in enumerate(resumes):
        split = copy_run(source, tmp_path / f"split{number}")
        checkpoint.checkpoint_root(split).joinpath("step-20").rename(split / "not-this-one")
        train(split, nproc, "--resume", *args, "--max-steps", "20", tiny=False)
        assert rel_l2(weights(split), weights(reference)) <= 1e-5, (nproc, args)


def test_table_sharding_is_refused_without_the_tables_strategy(tmp_path):
    done = python_m_gradmesh("train", "--model", "recsys", "--table-sharding", "table", "--run-dir", str(tmp_path / "r"))
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--table-sharding" in lines[0] and "--strategy tables" in lines[0]
    assert "Traceback" not in done.stderr and not (tmp_path / "r").exists()


def test_the_memory_formula_counts_the_rank_that_table_wise_placement_loads_most():
    """Tables of 20, 36, 36, 8 and 28 parameters over 3 ranks go 36 | 36 | 28 + 20 (then 8 to
    rank 0): the busiest holds 48, where even rows would be 128 / 3 each. The dense 100
    parameters count with their gradient and AdamW's two moments (4 x 4 bytes)."""
    from gradmesh.parallel import registry

    row = registry.get("tables")
    even = registry.ModelSize(params=228, table_params=128)
    whole = registry.ModelSize(params=228, table_params=128, whole_tables=(20, 36, 36, 8, 28))
    assert row.state_bytes(whole, 3) == 4 * (100 * 4 + 48)
    assert row.state_bytes(even, 3) == pytest.approx(4 * (100 * 4 + 128 / 3))

"""The recsys workload (issue 15): a DLRM-style model on a synthetic click log whose Bayes-optimal
AUC is known, so a trained model is judged against the ceiling."""

import json

import pytest
import torch

from catalogue import copy_run
from gradmesh.fault import checkpoint
from helpers import metrics, rel_l2, summary, train, weights

SMALL = ("--model", "recsys", "--set", "model.rows=4000", "--set", "model.samples=100000",
         "--max-steps", "350", "--global-batch-size", "256")


def test_the_click_log_is_deterministic_and_its_ids_follow_zipf():
    from gradmesh.data.clicks import ClickSpec, generate

    spec = ClickSpec(rows=(500, 500), samples=200_000, zipf=1.2)
    (train, held_out), (again, _) = generate(spec), generate(spec)
    assert torch.equal(train.ids, again.ids) and torch.equal(train.clicks, again.clicks)
    assert len(train) + len(held_out) == spec.samples and train.ids.max() < 500
    counts = torch.bincount(train.ids[:, 0], minlength=500).sort(descending=True).values.double()
    assert abs(counts[0] / counts[1] - 2**1.2) < 0.1  # P(rank k) ∝ k^-s: the two most popular ids
    assert abs(counts[0] / counts[3] - 4**1.2) < 0.3
    assert abs(train.clicks.mean() - train.truth.mean()) < 0.01  # clicks are drawn from the truth


def test_recsys_trains_near_the_bayes_optimal_auc(catalogue):
    run = catalogue.run(2, *SMALL, tiny=False)
    found = summary(run)["eval"]
    assert 0.85 < found["auc_ceiling"] < 1.0
    assert found["auc_ceiling"] - 0.03 <= found["auc"] <= found["auc_ceiling"]  # measured 0.018 below
    assert found["loss"] < 0.5 * (found["loss_ceiling"] + 0.58)  # well below a constant click rate's 0.58


def test_tables_train_row_wise_and_the_rest_with_torchs_own_optimizer():
    """Against the formula: a row no batch touched does not move; a touched row r moves by
    lr g_r / sqrt(sum over steps of mean_j g_rj^2); the dense layer matches plain AdamW."""
    from gradmesh.optim import with_rowwise_tables

    torch.manual_seed(0)
    table, dense = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 1)
    reference = torch.nn.Linear(4, 1)
    reference.load_state_dict(dense.state_dict())
    optimizer = with_rowwise_tables(torch.optim.AdamW)([table.weight, *dense.parameters()], tables=[table],
                                                       table_lr=0.1, lr=1e-2)
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    start, accumulator = table.weight.detach().clone(), torch.zeros(10)
    expected = start.clone()
    for ids in ([1, 3, 3], [3, 5]):
        ids = torch.tensor(ids)
        for net, opt in ((dense, optimizer), (reference, plain)):
            opt.zero_grad()
        dense(table(ids)).sum().backward()
        reference(table.weight[ids].detach()).sum().backward()
        grad = table.weight.grad.clone()
        accumulator += grad.pow(2).mean(dim=1)
        touched = grad.abs().sum(dim=1) > 0
        expected[touched] -= 0.1 * grad[touched] / (accumulator[touched].sqrt() + 1e-8).unsqueeze(1)
        optimizer.step()
        plain.step()
        table.weight.grad = None
    assert torch.allclose(table.weight, expected, atol=1e-6)
    assert torch.equal(table.weight[[0, 2, 4, 6, 7, 8, 9]], start[[0, 2, 4, 6, 7, 8, 9]])  # untouched rows
    assert all(torch.allclose(a, b) for a, b in zip(dense.parameters(), reference.parameters()))
    assert optimizer.state[table.weight]["sum"].shape == (10,)  # one accumulator per row, no second table


# grad_clip 0.02 binds here (the clipped model is 19% away from the unclipped one): the global norm
# every strategy clips by must include the tables' rows.
PARITY = ("--model", "recsys", "--set", "model.rows=4000", "--set", "model.samples=20000", "--max-steps", "20",
          "--global-batch-size", "256", "--checkpoint-every", "10", "--set", "checkpoint.keep=0",
          "--set", "train.grad_clip=0.02")


def test_two_ranks_train_the_single_process_model_tables_included(catalogue):
    """Data parallel recsys (dense table gradients all-reduced, row-wise Adagrad on every rank)
    equals one process: the reference the parameter-server paths will be held to."""
    assert rel_l2(weights(catalogue.run(2, *PARITY, tiny=False)), weights(catalogue.run(1, *PARITY, tiny=False))) <= 1e-5


def test_the_summary_shows_each_metric_beside_its_ceiling():
    from gradmesh.monitor.progress import summary_table

    found = {"loss": 0.43, "auc": 0.858, "auc_ceiling": 0.8678, "loss_ceiling": 0.42}
    summary = {"strategy": "ddp", "world_size": 2, "steps": 5, "samples": 10, "wall_s": 1.0, "samples_per_s": 10.0,
               "final_loss": 0.5, "eval": found, "run_dir": "runs/x"}
    table = summary_table(summary)
    rows = dict(zip(table.columns[0]._cells, table.columns[1]._cells))
    assert rows["eval auc"] == "0.8580 (ceiling 0.8678, -0.0098)"
    assert rows["eval loss"] == "0.4300 (ceiling 0.4200, +0.0100)" and "eval auc_ceiling" not in rows


def test_parameter_servers_hold_the_tables_row_sharded_and_train_the_single_process_model(catalogue):
    """Sync, 2 servers and 2 workers: the tables live on the servers by row range; workers pull
    the rows a batch looks up and push their gradients; the model after 20 steps is the one
    process's (tables by row-wise Adagrad, the rest by AdamW, as one process trains them)."""
    run = catalogue.run(4, *PARITY, "--strategy", "ps", "--ps-servers", "2", "--record-samples", tiny=False)
    reference = catalogue.run(1, *PARITY, tiny=False)
    assert rel_l2(weights(run), weights(reference)) <= 1e-5
    # evaluation: rank 0 pulls the rows each held-out batch looks up (no rank gathers the tables)
    found, expected = summary(run)["eval"], summary(reference)["eval"]
    assert abs(found["auc"] - expected["auc"]) < 1e-4 and abs(found["loss"] - expected["loss"]) < 1e-4


def test_the_wire_carries_only_the_rows_a_share_looks_up(catalogue):
    """Bytes on the wire over the run equal the formula, to the byte: per share, the dense vector
    pushed and pulled (8 bytes per dense parameter) and, per table, each distinct id looked up
    pulled and pushed (an 8-byte id and a 4-byte-per-dimension row each way), plus 72-byte
    headers: take and task, a pull and an answer, a bucket push and a commit per server, and
    per server holding any of the ids (of any table), a row request, its answer and a push; and
    per worker and segment, the last take and its done, less the pull the first share's take
    makes unnecessary (its task brings the dispatcher's shard along)."""
    run = catalogue.run(4, *PARITY, "--strategy", "ps", "--ps-servers", "2", "--record-samples", tiny=False)
    assert sum(row["wire_bytes"] for row in metrics(run)) == wire_formula(run, 2, 2, dense_bytes=8, headers=2 + 4 * 2, pulls=True)


def wire_formula(run, servers: int, workers: int, dense_bytes: int, headers: int, pulls: bool,
                 pushed_value_bytes: int = 4) -> int:
    """The bytes of a sparse-table run from its sample records: per share, `dense_bytes` per dense
    parameter and `headers` 72-byte headers, plus the tables' rows and their headers (`pulls`:
    the workers pull the dense vector; `pushed_value_bytes`: the width of a pushed row gradient's
    values; 2, fp16, also carries each push's scale, one value more)."""
    from gradmesh import workloads
    from gradmesh.config import build
    from gradmesh.data import clicks
    from gradmesh.parallel.ps import dense_parameters, table_rows

    cfg = build([{"model": {"name": "recsys", "rows": 4000, "samples": 20000}}])
    dataset, _ = clicks.generate(workloads.click_spec(cfg))
    segments = 2  # checkpoints at steps 10 and 20 end segments there
    dense = sum(p.numel() for _, p in dense_parameters(workloads.meta_model(cfg)))
    rows = workloads.click_spec(cfg).rows
    expected = 72 * 2 * workers * segments
    if pulls:  # a segment's first share needs no pull from the dispatcher
        expected -= 72 * workers * segments
    for rank in range(workers):  # the workers' records: the samples of each share they computed
        for record in map(json.loads, (run / f"samples-rank{rank}.jsonl").read_text().splitlines()):
            if not record["indices"]:
                continue
            ids = dataset.ids[torch.tensor(record["indices"])]
            expected += dense_bytes * dense + 72 * headers
            holders = set()  # one row request, its answer and one push per server holding any row
            for t in range(ids.shape[1]):
                looked_up = torch.unique(ids[:, t])
                holders |= {s for s in range(servers) if ((looked_up >= table_rows(rows[t], servers, s)[0])
                                                           & (looked_up < table_rows(rows[t], servers, s)[1])).any()}
                expected += len(looked_up) * (2 * 8 + (4 + pushed_value_bytes) * cfg.model.dim)
            expected += (72 * 3 + (pushed_value_bytes == 2) * 2) * len(holders)
    return expected


HYBRID = (*PARITY, "--strategy", "hybrid", "--ps-servers", "1", "--record-samples")


def test_hybrid_keeps_tables_on_servers_and_all_reduces_the_dense_part_exactly(catalogue):
    """2 workers and 1 server, sync: the tables' rows move as under ps, the dense part is
    all-reduced among the workers (clipping by the global norm binds, so each worker needs the
    tables' part from the servers); the model after 20 steps is the one process's."""
    run, reference = catalogue.run(3, *HYBRID, tiny=False), catalogue.run(1, *PARITY, tiny=False)
    assert rel_l2(weights(run), weights(reference)) <= 1e-5
    assert abs(summary(run)["eval"]["auc"] - summary(reference)["eval"]["auc"]) < 1e-4
    assert summary(run)["strategy"] == "hybrid"
    # Per share: the dense gradient handed to the workers' all-reduce (4 bytes per parameter),
    # take and task and a commit (the pull rides on the row request; no dense payload to or from
    # the server), and the tables' rows as under ps.
    assert sum(row["wire_bytes"] for row in metrics(run)) == wire_formula(run, 1, 2, dense_bytes=4, headers=2 + 1, pulls=False)


@pytest.mark.slow  # fast-tier budget: test_ps covers half-width pushes
def test_half_width_compression_under_hybrid_covers_the_tables_pushes_too(catalogue):
    """--compression fp16 under hybrid: the dense all-reduce and the tables' gradient rows pushed
    to the servers both travel at 2 bytes per value (each row push also carries its scale: the
    bytes, to the byte, as the formula above with those widths), and the model evaluates as the
    fp32 run's does. Its weights are not the fp32 run's to 1e-4: row-wise Adagrad divides a row's
    step by the row's own gradient, so a row whose pushes nearly cancel takes a full step in the
    direction rounding leaves (measured: rel. L2 1.6e-2 over all weights, 1e-3 on the dense part;
    eval loss and AUC within 4e-4 and 1e-4 relative)."""
    run, fp32 = catalogue.run(3, *HYBRID, "--compression", "fp16", tiny=False), catalogue.run(3, *HYBRID, tiny=False)
    assert sum(row["wire_bytes"] for row in metrics(run)) == wire_formula(run, 1, 2, dense_bytes=2, headers=2 + 1,
                                                                          pulls=False, pushed_value_bytes=2)
    assert 0 < rel_l2(weights(run), weights(fp32)) <= 5e-2
    found, expected = summary(run)["eval"], summary(fp32)["eval"]
    assert abs(found["loss"] / expected["loss"] - 1) < 2e-3 and abs(found["auc"] / expected["auc"] - 1) < 1e-3


@pytest.mark.slow  # fast-tier budget: test_sharded covers resharding resumes
def test_a_hybrid_checkpoint_resumes_under_another_strategy(catalogue, tmp_path):
    """The hybrid run's step-10 checkpoint (dense optimizer state from the workers, the tables and
    their row-wise accumulators collected on the server) resumed under ps with 2 servers (each
    keeping its rows of the tables it loads) ends where one process does after 20 steps."""
    split = copy_run(catalogue.run(3, *HYBRID, tiny=False), tmp_path / "split")
    checkpoint.checkpoint_root(split).joinpath("step-20").rename(split / "not-this-one")
    train(split, 4, "--resume", "--strategy", "ps", "--ps-servers", "2", "--max-steps", "20", tiny=False)
    assert rel_l2(weights(split), weights(catalogue.run(1, *PARITY, tiny=False))) <= 1e-5


def test_workers_never_hold_a_whole_table(catalogue):
    """With 2 million rows (122 MiB of tables) a hybrid worker's peak memory over its steps is
    within half the tables' bytes of the same job's at 4,000 rows: workers hold only the rows a
    share looks up. The server's peak grows by at least the tables' bytes (it holds them), so
    the measurement does see tables where they are. (The large run's tables train in ssp:1:
    no applied share is more than one step stale.)"""
    big = ("--set", "model.rows=2000000", "--max-steps", "5", "--ps-mode", "ssp:1")
    small, large = catalogue.run(3, *HYBRID, tiny=False), catalogue.run(3, *HYBRID, *big, tiny=False)
    table_bytes = 2_000_000 * 16 * 4

    def peaks(run):  # per rank, over the steps (before the final gather for evaluation and export)
        return [max(row["peak_memory_bytes"][rank] for row in metrics(run)) for rank in range(3)]

    grown = [b - a for a, b in zip(peaks(small), peaks(large))]
    assert all(growth < table_bytes / 2 for growth in grown[:2]), grown
    assert grown[2] >= table_bytes, grown
    # the whole run, evaluation (rank 0 pulls rows) and the last checkpoint (tables collected on
    # the server) included: worker 1 still never held a table (rank 0 writes the model file)
    at_end = summary(large)["peak_memory_bytes"][1] - summary(small)["peak_memory_bytes"][1]
    assert at_end < table_bytes / 2, at_end
    assert max(row["staleness_max"] for row in metrics(large)) <= 1


def test_any_row_range_of_a_table_is_made_alone_and_owned_by_one_server():
    """A server makes its rows without the rest of the table: any range of `init_rows` equals
    that slice of the whole table (across the 65,536-row blocks); and in the tables' one id space
    every id belongs to the server whose row range of its table holds it."""
    from gradmesh.models.dlrm import CHUNK, DLRM
    from gradmesh.parallel.ps import TableSpace, table_rows

    torch.manual_seed(0)
    model = DLRM((3 * CHUNK + 5, 7), dim=4, dense=3, hidden=8)
    whole = model.tables[0].weight.detach()
    for low, high in ((0, 1), (CHUNK - 3, CHUNK + 2), (CHUNK + 1, 3 * CHUNK + 5)):
        assert torch.equal(model.init_rows(0, low, high), whole[low:high])
    assert not torch.equal(model.init_rows(1, 0, 7), whole[:7])  # each table its own values
    rows, servers = [10, 7, 3], 3
    space = TableSpace(rows, servers)
    ids = torch.arange(sum(rows))
    owner = {int(i): s for s, mask in space.by_server(ids) for i in ids[mask]}
    for t, count in enumerate(rows):
        for s in range(servers):
            low, high = table_rows(count, servers, s)
            assert all(owner[space.offsets[t] + r] == s for r in range(low, high))

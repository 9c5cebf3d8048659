"""Non-finite training is never silent (issue 25, item 1): every rank agrees before the optimizer
whether any rank's loss or gradient is NaN or infinite; `stop` applies nothing and ends the run
(exit code 4, one line, an alert), `skip` drops the step's update on every rank, `rollback` goes
back to the last intact checkpoint and skips the bad step's batch. Skip and rollback train the
same model, at 1 and 2 ranks; the final weights never hold a NaN."""

import json

import pytest
import torch

from gradmesh.engine.nonfinite import check
from helpers import metrics, rel_l2, summary, train, weights

DIGITS = ["--model", "mlp-digits", "--max-steps", "12", "--optimizer", "sgd", "--global-batch-size", "32"]
TOLERANCE = 1e-5


def alerts(run_dir):
    """The run's non-finite alerts (a straggler alert may come too on 2 shared cores)."""
    rows = [json.loads(line) for line in (run_dir / "alerts.jsonl").read_text().splitlines()]
    return [row for row in rows if row["kind"] == "nonfinite"]


def test_a_huge_learning_rate_stops_the_run_with_one_line_and_no_nan_weights(tmp_path):
    """The issue's own case: before, exit 0, 'final train loss nan' and every weight NaN."""
    result = train(tmp_path, 2, *DIGITS, "--lr", "1e30", tiny=False, check=False)
    assert result.returncode == 4, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "alert at step 2" in lines[0] and "loss on rank(s) 0, 1" in lines[0] and "--lr" in lines[0]
    (alert,) = alerts(tmp_path)
    assert alert["kind"] == "nonfinite" and alert["step"] == 2 and alert["policy"] == "stop"
    assert alert["gradient"] == "layers.0.weight"  # the first of the model's parameters
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["loss"] is None and rows[1]["skipped"] == "nonfinite"
    assert not (tmp_path / "model.safetensors").exists()


@pytest.fixture(scope="module")
def skipped_runs(tmp_path_factory):
    """Rank 1's loss turns NaN at step 5 of 12: under skip at 1 and 2 ranks, under rollback (back
    to the step-3 checkpoint), and the same run without the fault."""
    root = tmp_path_factory.mktemp("nonfinite")
    runs = {}
    for name, nproc, extra in [("skip", 2, ["--inject", "nan:rank=1,step=5"]),
                               ("skip1", 1, ["--inject", "nan:rank=0,step=5"]),
                               ("rollback", 2, ["--inject", "nan:rank=1,step=5", "--checkpoint-every", "3"]),
                               ("clean", 2, [])]:
        policy = ["--on-nonfinite", name.rstrip("1")] if name != "clean" else []
        train(root / name, nproc, *DIGITS, *policy, *extra, tiny=False)
        runs[name] = root / name
    return runs


def test_skip_drops_the_step_on_every_rank(skipped_runs):
    run = skipped_runs["skip"]
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert rows[4]["skipped"] == "nonfinite" and rows[4]["loss"] is None
    assert all(r["loss"] is not None for r in rows if r["step"] != 5)
    (alert,) = alerts(run)
    assert (alert["step"], alert["loss_ranks"], alert["policy"]) == (5, [1], "skip")
    assert summary(run)["nonfinite_skipped_steps"] == [5]
    # A dropped update is a real difference (SGD at this learning rate moves the weights)...
    assert rel_l2(weights(run), weights(skipped_runs["clean"])) > 1e-4
    # ...and the same one at any world size: one process skipping its step 5 trains the same model.
    assert rel_l2(weights(run), weights(skipped_runs["skip1"])) <= TOLERANCE


def test_rollback_goes_back_to_the_checkpoint_and_skips_the_batch(skipped_runs):
    run = skipped_runs["rollback"]
    events = [json.loads(line) for line in (run / "faults.jsonl").read_text().splitlines()]
    assert [e["to_step"] for e in events if e.get("event") == "rollback"] == [3]
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 13))  # steps 4 and 5 written once, after the replay
    assert rows[4]["skipped"] == "rollback"
    assert alerts(run)[0]["policy"] == "rollback"
    # Replaying step 4 from the checkpoint and skipping batch 5 is skipping step 5's update.
    assert rel_l2(weights(run), weights(skipped_runs["skip"])) <= TOLERANCE
    assert all(torch.isfinite(t).all() for t in weights(run).values())


@pytest.mark.slow  # fast-tier budget: skip and rollback are covered above
def test_skips_in_a_row_and_rollbacks_that_do_not_help_stop_the_run(tmp_path):
    result = train(tmp_path / "skip", 2, *DIGITS, "--on-nonfinite", "skip", "--set", "fault.max_skips=3",
                   "--inject", "nan:rank=0,step=4,steps=5", tiny=False, check=False)
    assert result.returncode == 4 and "3 steps in a row" in result.stderr, result.stderr
    assert [a["step"] for a in alerts(tmp_path / "skip")] == [4, 5, 6]
    result = train(tmp_path / "rollback", 2, *DIGITS, "--on-nonfinite", "rollback", "--max-restarts", "1",
                   "--inject", "nan:rank=1,step=4,steps=5", tiny=False, check=False)
    assert result.returncode == 4 and "1 rollback(s) did not help" in result.stderr, result.stderr
    assert [a["step"] for a in alerts(tmp_path / "rollback")] == [4, 5]  # back to step 0, 4 skipped, then 5


def test_the_check_names_the_first_non_finite_gradient():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    model(torch.ones(2, 3)).sum().backward()
    assert check(model, torch.tensor(1.0), None, 0, 1, step=7) is None
    model[1].weight.grad[0, 1] = float("inf")
    found = check(model, torch.tensor(1.0), None, 0, 1, step=7)
    assert (found.step, found.loss_ranks, found.gradient_ranks, found.gradient) == (7, [], [0], "1.weight")
    found = check(model, torch.tensor(float("nan")), None, 0, 1, step=8)
    assert found.loss_ranks == [0] and "loss on rank(s) 0" in found.alert("stop", "x")["message"]


def test_parameter_servers_refuse_a_non_finite_push_and_skip_its_step_as_ddp_does(skipped_runs, tmp_path):
    """Sync ps is single-process training: with rank 1's push at step 5 refused under skip, the
    servers end on the model the 2-rank ddp run skipping step 5 ends on."""
    train(tmp_path, 3, *DIGITS, "--strategy", "ps", "--on-nonfinite", "skip", "--inject", "nan:rank=1,step=5",
          tiny=False)
    (alert,) = alerts(tmp_path)
    assert alert["step"] == 5 and "pushed by worker rank 1" in alert["push"]
    assert metrics(tmp_path)[4]["skipped"] == "nonfinite"
    assert rel_l2(weights(tmp_path), weights(skipped_runs["skip"])) <= TOLERANCE


@pytest.mark.slow  # fast-tier budget: the ps skip test covers a refused push
def test_a_huge_learning_rate_under_parameter_servers_stops_too(tmp_path):
    result = train(tmp_path, 3, *DIGITS, "--strategy", "ps", "--lr", "1e30", tiny=False, check=False)
    assert result.returncode == 4 and "refused by the parameter servers" in result.stderr, result.stderr
    assert not (tmp_path / "model.safetensors").exists()


CARRIED = '''
import copy, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from gradmesh.comm import hooks
from gradmesh.comm.reducer import MeanAllReduce
from gradmesh.engine import nonfinite
dist.init_process_group("gloo")
rank = dist.get_rank()
verdicts, same = [], []
for nan_rank in (None, 1):
    torch.manual_seed(0)
    model = hooks.register(DistributedDataParallel(torch.nn.Linear(4, 2)), MeanAllReduce())
    twin = copy.deepcopy(model.module)
    x = torch.randn(8, 4) + rank
    loss = model(x).square().sum()  # finite on both ranks, and so are both ranks' gradients
    told = torch.tensor(float("nan")) if rank == nan_rank else loss.detach()
    hooks.state_of(model).poison = told * 0
    loss.backward()
    verdicts.append(nonfinite.locally_finite(model, told))
    twin(x).square().sum().backward()  # the plain mean of the same gradients, for comparison
    for p in twin.parameters():
        dist.all_reduce(p.grad)
    same.append(all(torch.allclose(a.grad, b.grad / 2) for a, b in zip(model.parameters(), twin.parameters())))
print(f"rank {rank} verdicts {verdicts} same {same}")
'''


def test_the_gradient_all_reduce_carries_one_ranks_non_finite_loss_to_every_rank(tmp_path):
    """Under ddp no collective of its own: rank 1's NaN loss (its gradients finite) reaches rank 0
    through the gradient all-reduce, whose result is otherwise the plain mean; a compressor that
    need not keep a NaN falls back on the collective."""
    from gradmesh.comm.feedback import TopK
    from gradmesh.comm.reducer import CommCounter, Counted, Guarded, MeanAllReduce
    from helpers import gradmesh

    script = tmp_path / "carried.py"
    script.write_text(CARRIED)
    result = gradmesh("run", "--nproc", "2", str(script), timeout=120)
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        assert f"rank {rank} verdicts [True, False] same [True, False]" in result.stdout, result.stdout
    assert Guarded(Counted(MeanAllReduce(), CommCounter())).carries_nonfinite
    assert not Guarded(Counted(TopK(0.1), CommCounter())).carries_nonfinite

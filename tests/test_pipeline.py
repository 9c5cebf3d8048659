"""Pipeline parallelism (issue 4): every schedule and dp x pp keep the parity contract; the
cut is chosen from measured costs or given by hand, written to the run dir, and reshardable
checkpoints cross between pipeline and data-parallel runs; impossible pipelines are refused
before launch."""

import json

import pytest
import torch
import torch.nn as nn

from helpers import rel_l2, train, weights
from gradmesh.models import gpt
from gradmesh.parallel.pipeline import keep_only, pipeline_units, profile_units
from gradmesh.plan.partition import balanced_cut, equal_cut, stage_load
from runs import WIDE, References, at_step_10, digits_run, wide_run

TOLERANCE = 1e-5
PIPELINE = ("--strategy", "pipeline")


@pytest.fixture(scope="module")
def reference(catalogue):
    """The 4-layer model in one process (shared with test_tensor_parallel through the catalogue)."""
    return References(lambda optimizer: wide_run(catalogue, 1, optimizer))


# Every schedule under sgd (which, unlike adamw, a wrong gradient scale cannot fool) in the fast
# tier; the 1f1b sgd run is also test_monitor's. Under adamw the same schedules are slow.
@pytest.mark.parametrize("schedule, optimizer", [
    ("1f1b", "sgd"),  # the default schedule in the fast tier; the others in the slow one
    *(pytest.param(schedule, "sgd", marks=pytest.mark.slow) for schedule in ("gpipe", "interleaved")),
    *(pytest.param(schedule, "adamw", marks=pytest.mark.slow) for schedule in ("gpipe", "1f1b", "interleaved"))])
def test_each_schedule_matches_single_process(reference, catalogue, schedule, optimizer):
    run = wide_run(catalogue, 2, optimizer, *PIPELINE, "--pp-schedule", schedule)
    assert rel_l2(weights(run), reference[optimizer]) <= TOLERANCE
    plan = json.loads((run / "pipeline.json").read_text())
    stages = 4 if schedule == "interleaved" else 2
    assert [s["rank"] for s in plan["stages"]] == [s % 2 for s in range(stages)]
    held = [u for s in plan["stages"] for u in s["units"]]
    assert held == ["wte", "h.0", "h.1", "h.2", "h.3", "ln_f"]  # every unit once, in order


@pytest.mark.slow  # 4 ranks; the 2-rank schedules above keep the contract in the fast tier
@pytest.mark.parametrize("layout, optimizer", [  # four stages under sgd (adamw: every schedule at 2 ranks)
    (["--strategy", "pipeline"], "sgd"), (["--mesh", "dp=2,pp=2"], "adamw"), (["--mesh", "dp=2,pp=2"], "sgd")])
def test_four_ranks_match_single_process(reference, catalogue, layout, optimizer):
    assert rel_l2(weights(wide_run(catalogue, 4, optimizer, *layout)), reference[optimizer]) <= TOLERANCE


def test_manual_cut_is_used_and_keeps_parity(reference, tmp_path):
    train(tmp_path, 2, *WIDE, "--max-steps", "20", "--global-batch-size", "16", "--optimizer", "sgd",
          *PIPELINE, "--pp-split", "h.3")
    plan = json.loads((tmp_path / "pipeline.json").read_text())
    assert plan["cut"] == "manual"
    assert [s["units"] for s in plan["stages"]] == [["wte", "h.0", "h.1", "h.2"], ["h.3", "ln_f"]]
    assert rel_l2(weights(tmp_path), reference["sgd"]) <= TOLERANCE


def test_short_last_batch_is_padded_with_weightless_samples(catalogue):
    """mlp-digits: step 15 holds 93 of 96 samples; the pipeline pads its share with weight 0."""
    one = digits_run(catalogue, 1)  # shared with test_parity and test_data_order
    pp = digits_run(catalogue, 2, *PIPELINE, "--pp-schedule", "gpipe", "--microbatches", "5")
    assert rel_l2(weights(pp), weights(one)) <= TOLERANCE


@pytest.mark.slow  # three runs; checkpoints crossing strategies stay in the fast tier (test_sharded, tp -> fsdp)
def test_pipeline_checkpoint_resumes_under_ddp_and_back(reference, catalogue, tmp_path):
    run = at_step_10(wide_run(catalogue, 2, "adamw", *PIPELINE, "--pp-schedule", "1f1b"), tmp_path / "run")
    train(run, 2, "--resume", "--strategy", "ddp", "--max-steps", "15", *WIDE)
    train(run, 2, "--resume", *PIPELINE, "--pp-schedule", "gpipe", "--max-steps", "20", *WIDE)
    assert rel_l2(weights(run), reference["adamw"]) <= TOLERANCE


@pytest.mark.parametrize("args, words", [
    (["--nproc", "4", "--strategy", "pipeline", "--set", "model.n_layer=1"], ["4 stages", "model has 3", "pp <= 3"]),
    (["--nproc", "2", "--strategy", "pipeline", "--pp-schedule", "interleaved", "--set", "model.n_layer=1"],
     ["4 stages", "2 stages per rank"]),
    (["--nproc", "4", "--strategy", "pipeline", "--microbatches", "2"], ["fewer than the 4 pipeline stages"]),
    (["--nproc", "2", "--strategy", "pipeline", "--pp-split", "h.9"], ["'h.9' is not a unit", "h.0"]),
    (["--nproc", "2", "--strategy", "pipeline", "--grad-accum", "2"], ["--grad-accum must be 1"]),
    (["--nproc", "2", "--strategy", "pipeline", "--global-batch-size", "8", "--microbatches", "16"],
     ["exceeds the 8 samples"]),
    (["--nproc", "2", "--strategy", "pipeline", "--pp-schedule", "zigzag"], ["invalid choice", "interleaved"]),
])
def test_impossible_pipelines_are_refused_before_launch(cli, tmp_path, args, words):
    result = cli("train", "--run-dir", str(tmp_path), *args)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and all(w in result.stderr for w in words), result.stderr


# -- the cut (single process, no timing asserted) -------------------------------------------------

def test_stage_views_keep_names_and_compose_to_the_whole_model():
    torch.manual_seed(0)
    model = gpt.GPT(gpt.GPTConfig(vocab_size=11, block_size=8, n_layer=3, n_head=2, n_embd=16))
    units = pipeline_units(model)
    cut = [{"wte", "wpe", "drop", "h.0"}, {"h.1", "h.2"}, {"ln_f", "lm_head"}]
    views = [keep_only(model, names) for names in cut]
    names = [n for v in views for n in v.state_dict()]
    assert names == list(model.state_dict())  # each parameter in exactly one stage, same name
    x = torch.randint(0, 11, (3, 8))
    out = x
    for view in views:
        out = view(out)
    assert torch.equal(out, model(x))
    assert [u[0] for u in units] == ["wte", "h.0", "h.1", "h.2", "ln_f"]


def _brute_force_bottleneck(costs, stages):
    import itertools

    return min(max(stage_load(costs, [0, *cuts])) for cuts in itertools.combinations(range(1, len(costs)), stages - 1))


def test_balanced_cut_beats_equal_layers_on_an_unbalanced_model():
    """One wide layer among narrow ones: the measured bytes (exact, not timed) say where to cut."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 512), nn.Linear(512, 512), nn.Linear(512, 16),
                          nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 10))
    example = (torch.randn(4, 16), torch.randint(0, 10, (4,)))
    costs = profile_units(model, pipeline_units(model), example,
                          lambda out, y: nn.functional.cross_entropy(out, y, reduction="none"),
                          optimizer_slots=2, in_flight=2, repeats=1)
    costs = [type(c)(c.name, 0.0, c.bytes) for c in costs]  # memory only: deterministic
    balanced, equal = balanced_cut(costs, 2), equal_cut(len(costs), 2)
    assert equal == [0, 4]
    assert balanced == [0, 3]  # the 512x512 layer with what precedes it; the rest apart
    assert max(stage_load(costs, balanced)) < max(stage_load(costs, equal))
    for stages in (2, 3, 4):
        assert max(stage_load(costs, balanced_cut(costs, stages))) == pytest.approx(_brute_force_bottleneck(costs, stages))

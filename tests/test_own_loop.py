"""`gradmesh.Loop` (issue 29): a user's own training loop on gradmesh's strategies, held to the
single-process run of the same script (examples/own_loop.py), with micro-batches and an epoch's
short last batch, under `gradmesh run` and torchrun, and resumed under another strategy."""

import functools
import importlib.util
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import gradmesh, metrics, rel_l2, summary, weights

EXAMPLE = Path(__file__).parent.parent / "examples" / "own_loop.py"
SHORT = ("--steps", "20", "--samples", "1003", "--grad-accum", "2")
"""15 full batches of 64, then 43 samples: shares of 22 and 21 in micro-batches of 11, 11 / 11, 10."""
EMPTY = ("--steps", "20", "--samples", "961", "--grad-accum", "2")
"""The 16th batch holds one sample: every rank but one has an empty share (one sample at weight 0)."""


def _python(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, str(EXAMPLE), "--run-dir", str(run_dir), *args],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    return done


@functools.cache
def _single(tmp_root: Path, *args: str) -> Path:
    run_dir = tmp_root / f"one-{abs(hash(args))}"
    _python(run_dir, *args)
    return run_dir


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    root = tmp_path_factory.mktemp("own-loop-reference")
    return lambda *args: _single(root, *args)


def _run(run_dir: Path, nproc: int, *args: str) -> Path:
    done = gradmesh("run", "--nproc", str(nproc), str(EXAMPLE), "--run-dir", str(run_dir), *args, timeout=180)
    assert done.returncode == 0, done.stderr
    return run_dir


@pytest.mark.parametrize(("strategy", "data", "optimizer"), [
    ("ddp", SHORT, "adamw"), ("zero1", EMPTY, "sgd"), ("fsdp", EMPTY, "adamw"),
])
def test_two_ranks_train_the_single_process_model(tmp_path, single, strategy, data, optimizer):
    args = (*data, "--optimizer", optimizer)
    run = _run(tmp_path / strategy, 2, *args, "--strategy", strategy)
    assert rel_l2(weights(run), weights(single(*args))) <= 1e-5
    assert summary(run)["strategy"] == strategy and summary(run)["world_size"] == 2
    assert summary(run)["samples"] == 20 * 64 - (64 - int(data[3]) % 64)  # every sample of the short batch, once


@pytest.mark.slow  # four ranks of each; the two-rank cases above stay in the fast tier
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "fsdp"])
def test_four_ranks_train_the_single_process_model(tmp_path, single, strategy):
    args = (*EMPTY, "--optimizer", "sgd")
    assert rel_l2(weights(_run(tmp_path / strategy, 4, *args, "--strategy", strategy)), weights(single(*args))) <= 1e-5


@pytest.mark.slow  # torchrun starts fresh interpreters (no fork from a warm launcher): the slowest case
def test_under_torchrun_the_same_script_trains_the_same_model(tmp_path, single):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert torchrun, "torchrun comes with torch"
    done = subprocess.run([torchrun, "--nproc-per-node", "2", str(EXAMPLE), "--run-dir", str(tmp_path / "tr"), *SHORT],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert rel_l2(weights(tmp_path / "tr"), weights(single(*SHORT))) <= 1e-5


def test_a_run_resumed_under_another_strategy_equals_one_uninterrupted(tmp_path, single):
    """10 steps of ddp with a checkpoint every 5, then steps 11-20 resumed under fsdp."""
    half = ("--steps", "10", *SHORT[2:])
    _run(tmp_path / "r", 2, *half, "--checkpoint-every", "5")
    assert sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir()) == ["step-10", "step-5"]
    _run(tmp_path / "r", 2, *SHORT, "--checkpoint-every", "5", "--resume", "--strategy", "fsdp")
    assert rel_l2(weights(tmp_path / "r"), weights(single(*SHORT))) <= 1e-5
    rows = metrics(tmp_path / "r")
    assert [row["step"] for row in rows] == list(range(1, 21))
    assert all("batch_mean_target" in row for row in rows)  # what the loop logged, in its step's row


def _script(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "misuse.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.nn as nn, gradmesh
        data = [(torch.randn(3), torch.randn(1)) for _ in range(16)]
    """) + textwrap.dedent(body))
    return script


@pytest.mark.parametrize(("body", "message"), [
    ("""
     gm = gradmesh.Loop(strategy="pipeline")
     """, "gradmesh.Loop runs strategy 'pipeline' only through gradmesh.Trainer"),
    ("""
     gm = gradmesh.Loop(run_dir=None)
     model = nn.Linear(3, 1)
     model, opt = gm.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
     for step, (x, y) in gm.batches(data, 4, 2):
         gm.backward(((model(x) - y) ** 2).mean())
     """, "step 1: call gm.step(optimizer) after gm.backward(loss)"),
    ("""
     gm = gradmesh.Loop(run_dir=None)
     model = nn.Linear(3, 1)
     gm.prepare(model, torch.optim.SGD([model.weight], lr=0.1))
     """, "Loop.prepare needs an optimizer over every parameter"),
])
def test_misuse_is_named_in_one_line(tmp_path, body, message):
    done = subprocess.run([sys.executable, str(_script(tmp_path, body))], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert message in done.stderr.strip().splitlines()[-1], done.stderr


def test_save_inside_the_loop_checkpoints_the_step_under_way_and_early_stop_ends_there(tmp_path):
    """gm.save() after step 3's gm.step: checkpoint step-3 (written after the step's record); a
    loop left at step 5 of 8 ends there: its final checkpoint and summary say step 5."""
    body = f"""
        gm = gradmesh.Loop(run_dir={str(tmp_path / "r")!r}, quiet=True)
        model = nn.Linear(3, 1)
        model, opt = gm.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        for step, (x, y) in gm.batches(data, 4, 8):
            gm.backward(((model(x) - y) ** 2).mean())
            gm.step(opt)
            if step == 3:
                gm.save()
            if step == 5:
                break
        gm.close()
    """
    done = subprocess.run([sys.executable, str(_script(tmp_path, body))], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir()) == ["step-3", "step-5"]
    assert summary(tmp_path / "r")["steps"] == 5 and [r["step"] for r in metrics(tmp_path / "r")] == [1, 2, 3, 4, 5]


HF_EXAMPLE = EXAMPLE.with_name("hf_causal_lm.py")
HF_TINY = ("--steps", "10", "--global-batch-size", "8", "--block-size", "32", "--layers", "2", "--width", "64",
           "--max-chars", "60000")


@pytest.mark.slow  # two runs of a transformers model; test_hf.py keeps hf parity in the fast tier
def test_the_hugging_face_example_under_fsdp_trains_the_single_process_model(tmp_path):
    """examples/hf_causal_lm.py: transformers' GPT-2 from its config in an own loop, FSDP on 2 ranks."""
    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    one = subprocess.run([sys.executable, str(HF_EXAMPLE), "--run-dir", str(tmp_path / "one"), *HF_TINY],
                         capture_output=True, text=True, timeout=180)
    assert one.returncode == 0, one.stderr
    done = gradmesh("run", "--nproc", "2", str(HF_EXAMPLE), "--strategy", "fsdp", "--run-dir", str(tmp_path / "two"),
                    *HF_TINY, timeout=180)
    assert done.returncode == 0, done.stderr
    assert rel_l2(weights(tmp_path / "two"), weights(tmp_path / "one")) <= 1e-5
    assert summary(tmp_path / "two")["strategy"] == "fsdp"


@pytest.mark.slow  # test_vision.py keeps synchronised BatchNorm's parity in the fast tier
def test_the_resnet_example_trains_the_single_process_model_with_synchronised_batch_norm(tmp_path):
    """examples/resnet_shapes.py at width 8: BatchNorm statistics over the global batch on 2 ranks,
    as one process computes them (no short batch: a few images per rank make BatchNorm
    ill-conditioned). SGD: AdamW at a constant 2e-3 from step 1 turns the rounding noise of
    BatchNorm's near-zero gradients into lr-sized steps (1.4e-4 after 6 steps, the Trainer's
    runs alike, bit for bit); SGD measures 6.5e-8 on the same data, and exposes a wrong weighting."""
    if importlib.util.find_spec("torchvision") is None:  # not imported here: gradmesh's import makes it importable
        pytest.skip("torchvision is not installed")
    example = EXAMPLE.with_name("resnet_shapes.py")
    tiny = ("--steps", "6", "--global-batch-size", "32", "--samples", "480", "--width", "8", "--optimizer", "sgd")
    one = subprocess.run([sys.executable, str(example), "--run-dir", str(tmp_path / "one"), *tiny],
                         capture_output=True, text=True, timeout=180)
    assert one.returncode == 0, one.stderr
    two = gradmesh("run", "--nproc", "2", str(example), "--run-dir", str(tmp_path / "two"), *tiny, timeout=180)
    assert two.returncode == 0, two.stderr
    assert rel_l2(weights(tmp_path / "two"), weights(tmp_path / "one")) <= 1e-5
    accuracy = [line for line in two.stdout.splitlines() if "held-out accuracy" in line]
    assert accuracy and accuracy[0] in one.stdout  # the same held-out accuracy printed by both

"""Built-in workloads end to end through the CLI, and the run directory they leave."""

import json
import tomllib

import torch

from gradmesh.config import build
from helpers import metrics, summary, train, weights
from runs import RECORDED, STEPS, ddp_run


def test_run_directory_layout_and_contents(catalogue):
    run = ddp_run(catalogue, 2, "adamw")  # 20 steps of 16, a checkpoint every 5, the newest 2 kept
    cfg = build([tomllib.loads((run / "config.toml").read_text())])
    assert cfg.model.n_layer == 2 and cfg.train.max_steps == 20  # the resolved config
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 21))
    for key in ("step", "loss", "lr", "samples", "step_time_s", "samples_per_s"):
        assert all(key in r for r in rows)
    assert rows[-1]["samples"] == 320
    info = summary(run)
    for key in ("steps", "samples", "wall_s", "samples_per_s", "final_loss", "eval", "world_size",
                "strategy", "peak_memory_bytes"):
        assert key in info
    assert info["world_size"] == 2 and len(info["peak_memory_bytes"]) == 2
    assert all(p > 10 * 2**20 for p in info["peak_memory_bytes"])
    assert info["final_loss"] == rows[-1]["loss"] and "loss" in info["eval"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-15", "step-20"]
    # Final weights are named as in the plain model's state_dict (no DDP "module." prefix).
    from gradmesh.models.gpt import GPT, GPTConfig
    vocab = json.loads((run / "vocab.json").read_text())
    plain = GPT(GPTConfig(vocab_size=len(vocab), block_size=32, n_layer=2, n_head=2, n_embd=32))
    saved = weights(run)
    assert saved.keys() == plain.state_dict().keys()
    plain.load_state_dict(saved)


def test_mlp_digits_learns(tmp_path):
    train(tmp_path, 2, "--model", "mlp-digits", "--max-steps", "150", "--global-batch-size", "64", tiny=False)
    info = summary(tmp_path)
    assert info["eval"]["accuracy"] >= 0.9, info["eval"]
    assert info["final_loss"] < metrics(tmp_path)[0]["loss"] / 4


def test_gpt_char_on_a_user_text_folder_learns_and_samples(tmp_path):
    data = tmp_path / "text"
    data.mkdir()
    (data / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 300)
    (data / "b.md").write_text("pack my box with five dozen liquor jugs! " * 300)
    run = tmp_path / "run"
    train(run, 2, "--data", str(data), "--max-steps", "60", "--global-batch-size", "16",
          "--set", "train.sample_chars=40", "--set", "train.lr=0.005")
    info = summary(run)
    assert info["eval"]["loss"] < 1.5  # uniform guessing over the ~30 characters is ~3.4
    assert info["sample"].startswith("def ") and len(info["sample"]) == 44
    assert set(info["sample"][4:]) <= set(json.loads((run / "vocab.json").read_text()))


def test_single_process_is_deterministic(catalogue, tmp_path):
    """A second, fresh run with the same arguments as the catalogue's single-process reference."""
    train(tmp_path, 1, *STEPS, "--optimizer", "adamw", *RECORDED)
    a, b = weights(tmp_path), weights(ddp_run(catalogue, 1, "adamw"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_digits_read_from_scikit_learns_file_are_its_loaders():
    """mlp-digits reads scikit-learn's bundled file itself (no scikit-learn import in a worker);
    what it reads is exactly what scikit-learn's own loader returns."""
    import numpy as np
    from sklearn.datasets import load_digits

    from gradmesh.data.digits import bundled_digits

    data, target = bundled_digits()
    reference = load_digits()
    assert np.array_equal(data, reference.data) and np.array_equal(target, reference.target)
    assert data.shape == (1797, 64) and sorted(set(target.tolist())) == list(range(10))

"""Built-in workloads end to end through the CLI, and the run directory they leave."""

import json
import tomllib

import torch

from gradmesh.config import build
from helpers import metrics, summary, train, weights


def test_run_directory_layout_and_contents(tmp_path):
    train(tmp_path, 2, "--max-steps", "6", "--global-batch-size", "8", "--checkpoint-every", "3")
    cfg = build([tomllib.loads((tmp_path / "config.toml").read_text())])
    assert cfg.model.n_layer == 2 and cfg.train.max_steps == 6  # the resolved config
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 7))
    for key in ("step", "loss", "lr", "samples", "step_time_s", "samples_per_s"):
        assert all(key in r for r in rows)
    assert rows[-1]["samples"] == 48
    info = summary(tmp_path)
    for key in ("steps", "samples", "wall_s", "samples_per_s", "final_loss", "eval", "world_size",
                "strategy", "peak_memory_bytes"):
        assert key in info
    assert info["world_size"] == 2 and len(info["peak_memory_bytes"]) == 2
    assert all(p > 10 * 2**20 for p in info["peak_memory_bytes"])
    assert info["final_loss"] == rows[-1]["loss"] and "loss" in info["eval"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-3", "step-6"]
    # Final weights are named as in the plain model's state_dict (no DDP "module." prefix).
    from gradmesh.models.gpt import GPT, GPTConfig
    vocab = json.loads((tmp_path / "vocab.json").read_text())
    plain = GPT(GPTConfig(vocab_size=len(vocab), block_size=32, n_layer=2, n_head=2, n_embd=32))
    saved = weights(tmp_path)
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


def test_single_process_is_deterministic(tmp_path):
    train(tmp_path / "a", 1, "--max-steps", "5")
    train(tmp_path / "b", 1, "--max-steps", "5")
    a, b = weights(tmp_path / "a"), weights(tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in a)

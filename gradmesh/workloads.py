"""The built-in workloads, assembled from plain models and datasets for the Trainer.

gpt-char: a small GPT on characters of the Python standard library's source (or --data text);
mlp-digits: an MLP on scikit-learn's 8x8 digits. Both go through the public Trainer API.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from gradmesh.config import Config
from gradmesh.data import fetch
from gradmesh.data.corpus import CharVocab, char_datasets, load_text
from gradmesh.data.digits import digits_datasets
from gradmesh.errors import UsageError
from gradmesh.models import gpt, mlp


@dataclass
class Workload:
    model: nn.Module
    loss_fn: Callable
    train_data: torch.utils.data.Dataset
    eval_fn: Callable[[nn.Module], dict]
    criterion: Callable | None = None
    """(model output, targets) -> one loss per sample: what a pipeline's last stage computes."""
    finish: Callable[[dict], str | None] = lambda weights: None
    """Given the final full weights on rank 0, a text to show (gpt-char: a generated sample)."""
    info: dict = field(default_factory=dict)


def _held_out_batches(dataset, batches: int, batch_size: int) -> list[list[int]]:
    """Evenly spaced held-out samples, the same on every rank and every run."""
    count = min(len(dataset), batches * batch_size)
    picks = torch.linspace(0, len(dataset) - 1, count).long().tolist()
    return [picks[i : i + batch_size] for i in range(0, count, batch_size)]


def _mean_eval(model, dataset, batches, loss_fn, device, extra=None) -> dict:
    total, correct, count = 0.0, 0, 0
    for indices in batches:
        data = tuple(t.to(device) for t in fetch(dataset, indices))
        total += loss_fn(model, data).sum().item()
        if extra:
            correct += extra(model, data)
        count += len(indices)
    metrics = {"loss": total / count}
    if extra:
        metrics["accuracy"] = correct / count
    return metrics


def gpt_char(cfg: Config, device: torch.device) -> Workload:
    text = load_text(cfg.data.path, cfg.data.max_chars)
    train, held_out, vocab = char_datasets(text, cfg.model.block_size, cfg.data.eval_fraction)
    model_cfg = gpt.GPTConfig(
        vocab_size=len(vocab.chars), block_size=cfg.model.block_size, n_layer=cfg.model.n_layer,
        n_head=cfg.model.n_head, n_embd=cfg.model.n_embd, dropout=cfg.model.dropout, bias=cfg.model.bias,
    )
    model = gpt.GPT(model_cfg)
    batches = _held_out_batches(held_out, cfg.train.eval_batches, cfg.train.global_batch_size)

    def evaluate(net):
        return _mean_eval(net, held_out, batches, gpt.per_sample_loss, device)

    def sample(weights: dict) -> str | None:
        if cfg.train.sample_chars == 0:
            return None
        plain = gpt.GPT(model_cfg)
        plain.load_state_dict(weights)
        plain.eval()
        start = "def " if set("def ") <= set(vocab.chars) else text[0]
        prompt = vocab.encode(start)[None, :]
        out = plain.generate(prompt, cfg.train.sample_chars, top_k=10,
                             generator=torch.Generator().manual_seed(cfg.train.seed))
        return vocab.decode(out[0].tolist())

    info = {"vocab": vocab.chars, "corpus_chars": len(text), "train_samples": len(train),
            "eval_samples": len(held_out)}
    return Workload(model, gpt.per_sample_loss, train, evaluate, gpt.sample_losses, sample, info)


def mlp_digits(cfg: Config, device: torch.device) -> Workload:
    train, held_out = digits_datasets()
    model = mlp.MLP(hidden=cfg.model.hidden, dropout=cfg.model.dropout)
    batches = _held_out_batches(held_out, len(held_out), cfg.train.global_batch_size)

    def correct(net, data):
        features, labels = data
        return (net(features).argmax(dim=1) == labels).sum().item()

    def evaluate(net):
        return _mean_eval(net, held_out, batches, mlp.per_sample_loss, device, correct)

    info = {"train_samples": len(train), "eval_samples": len(held_out)}
    return Workload(model, mlp.per_sample_loss, train, evaluate, mlp.sample_losses, info=info)


BUILDERS = {"gpt-char": gpt_char, "mlp-digits": mlp_digits}


def build(cfg: Config, device: torch.device) -> Workload:
    return BUILDERS[cfg.model.name](cfg, device)


def meta_model(cfg: Config) -> nn.Module:
    """The configured model on the meta device (no memory, no data): for checks before launch."""
    with torch.device("meta"):
        if cfg.model.name == "gpt-char":
            vocab = CharVocab.of(load_text(cfg.data.path, cfg.data.max_chars))
            return gpt.GPT(gpt.GPTConfig(
                vocab_size=len(vocab.chars), block_size=cfg.model.block_size, n_layer=cfg.model.n_layer,
                n_head=cfg.model.n_head, n_embd=cfg.model.n_embd, bias=cfg.model.bias))
        return mlp.MLP(hidden=cfg.model.hidden)


def model_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of the configured model."""
    return {name: tuple(t.shape) for name, t in meta_model(cfg).state_dict().items()}


def check_inputs(cfg: Config) -> None:
    """Fail fast (UsageError) on data problems before any worker starts."""
    if cfg.data.path and cfg.model.name != "gpt-char":  # silently training on other data would mislead
        raise UsageError(f"data.path {cfg.data.path!r}: {cfg.model.name} trains on its own built-in data; "
                         "--data is read by gpt-char only")
    if cfg.model.name == "gpt-char":
        text = load_text(cfg.data.path, cfg.data.max_chars)
        char_datasets(text, cfg.model.block_size, cfg.data.eval_fraction)


__all__ = ["Workload", "build", "check_inputs", "CharVocab"]

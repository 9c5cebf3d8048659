"""The built-in workloads, assembled from plain models and datasets for the Trainer.

gpt-char: a small GPT on characters of the Python standard library's source (or --data text);
hf:gpt2 and hf:llama: Hugging Face transformers models on the same text (`gradmesh.hf`);
mlp-digits: an MLP on scikit-learn's 8x8 digits; recsys: a DLRM-style click model on a synthetic
click log with a known ceiling; resnet: torchvision's ResNet-18 on generated images of coloured
shapes, whose ceiling is 100%. All go through the public Trainer API, but rl-cartpole, which
learns from its own actors' experience (`gradmesh.loop.actor_learner`; here only its model).
"""

from collections.abc import Callable, Sized
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from gradmesh.config import Config
from gradmesh.config.workload import HF_MODELS, RL_MODELS, TEXT_MODELS
from gradmesh.data import clicks, fetch, shapes
from gradmesh.data.corpus import CharVocab, char_datasets, load_text
from gradmesh.data.digits import digits_datasets
from gradmesh.errors import UsageError
from gradmesh.models import dlrm, gpt, mlp, resnet
from gradmesh.models.actor_critic import ActorCritic
from gradmesh.parallel.batchnorm import convert_sync_batchnorm


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
    optimizer: tuple[type, dict] | None = None
    """(optimizer class, keyword arguments) when the workload needs its own (recsys: row-wise
    Adagrad for the tables); None: the one `train.optimizer` names."""


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


def _char_workload(cfg: Config, device: torch.device, make_model, loss_fn, generate, criterion=None) -> Workload:
    """gpt-char's text, vocabulary, held-out loss and sample around the model that
    make_model(vocab_size) builds; generate(model, prompt, chars, generator) samples from it."""
    text = load_text(cfg.data.path, cfg.data.max_chars)
    train, held_out, vocab = char_datasets(text, cfg.model.block_size, cfg.data.eval_fraction)
    model = make_model(len(vocab.chars))
    batches = _held_out_batches(held_out, cfg.train.eval_batches, cfg.train.global_batch_size)

    def evaluate(net):
        return _mean_eval(net, held_out, batches, loss_fn, device)

    def sample(weights: dict) -> str | None:
        if cfg.train.sample_chars == 0:
            return None
        plain = make_model(len(vocab.chars))
        plain.load_state_dict(weights)
        plain.eval()
        start = "def " if set("def ") <= set(vocab.chars) else text[0]
        prompt = vocab.encode(start)[None, :]
        out = generate(plain, prompt, cfg.train.sample_chars, torch.Generator().manual_seed(cfg.train.seed))
        return vocab.decode(out[0].tolist())

    info = {"vocab": vocab.chars, "corpus_chars": len(text), "train_samples": len(train), "eval_samples": len(held_out)}
    return Workload(model, loss_fn, train, evaluate, criterion, sample, info)


def _gpt_config(cfg: Config, vocab_size: int) -> gpt.GPTConfig:
    return gpt.GPTConfig(
        vocab_size=vocab_size,
        block_size=cfg.model.block_size,
        n_layer=cfg.model.n_layer,
        n_head=cfg.model.n_head,
        n_embd=cfg.model.n_embd,
        dropout=cfg.model.dropout,
        bias=cfg.model.bias,
    )


def gpt_char(cfg: Config, device: torch.device) -> Workload:
    def make(vocab_size: int) -> gpt.GPT:
        return gpt.GPT(_gpt_config(cfg, vocab_size))

    def generate(model, prompt, chars, generator):
        return model.generate(prompt, chars, top_k=10, generator=generator)

    return _char_workload(cfg, device, make, gpt.per_sample_loss, generate, gpt.sample_losses)


def hf_char(cfg: Config, device: torch.device) -> Workload:
    """A Hugging Face transformers model (hf:gpt2, hf:llama) on gpt-char's text. No criterion:
    a transformers model's forward runs all its blocks, so no pipeline stage can run a slice."""
    from gradmesh import hf

    def make(vocab_size: int) -> nn.Module:
        return hf.build_model(cfg, vocab_size)

    return _char_workload(cfg, device, make, hf.per_sample_loss, hf.sampler(cfg))


def _correct(net, data) -> int:
    inputs, labels = data
    return int((net(inputs).argmax(dim=1) == labels).sum().item())


def mlp_digits(cfg: Config, device: torch.device) -> Workload:
    train, held_out = digits_datasets()
    model = mlp.MLP(hidden=cfg.model.hidden, dropout=cfg.model.dropout)
    batches = _held_out_batches(held_out, len(held_out), cfg.train.global_batch_size)

    def evaluate(net):
        return _mean_eval(net, held_out, batches, mlp.per_sample_loss, device, _correct)

    info = {"train_samples": len(train), "eval_samples": len(held_out)}
    return Workload(model, mlp.per_sample_loss, train, evaluate, mlp.sample_losses, info=info)


def resnet_shapes(cfg: Config, device: torch.device) -> Workload:
    train, held_out = shapes.generate(cfg.model.samples, cfg.model.image_size)
    model = resnet.resnet18(len(shapes.SHAPES), cfg.model.width)
    if cfg.model.sync_bn:  # bound to the data-parallel ranks where the strategies are applied
        model = convert_sync_batchnorm(model)
    batches = _held_out_batches(held_out, len(held_out), cfg.train.global_batch_size)

    def evaluate(net):
        metrics = _mean_eval(net, held_out, batches, resnet.per_sample_loss, device, _correct)
        return {**metrics, "accuracy_ceiling": shapes.ACCURACY_CEILING}

    info = {"train_samples": len(train), "eval_samples": len(held_out), "classes": list(shapes.SHAPES)}
    return Workload(model, resnet.per_sample_loss, train, evaluate, resnet.sample_losses, info=info)


def click_spec(cfg: Config) -> clicks.ClickSpec:
    tables, rows = cfg.model.tables, cfg.model.rows
    per_table = tuple(rows // tables + (1 if t < rows % tables else 0) for t in range(tables))
    return clicks.ClickSpec(rows=per_table, samples=cfg.model.samples, zipf=cfg.model.zipf)


def recsys(cfg: Config, device: torch.device, remote_tables: bool = False) -> Workload:
    spec = click_spec(cfg)
    train, held_out = clicks.generate(spec)
    model = dlrm.DLRM(spec.rows, cfg.model.dim, clicks.DENSE, cfg.model.hidden, materialize=not remote_tables)
    labels = held_out.clicks.numpy()
    batch = max(cfg.train.global_batch_size, 4096)
    ceiling: dict[str, float] = {}

    def evaluate(net):
        # scikit-learn is imported (and the ceilings computed) by the ranks that evaluate only:
        # its import alone costs memory (docs/benchmarks.md#recsys) that a parameter server or a
        # worker under ps need not hold
        from sklearn.metrics import log_loss, roc_auc_score

        if not ceiling:
            ceiling.update(
                auc_ceiling=float(roc_auc_score(labels, held_out.truth.numpy())),
                loss_ceiling=float(log_loss(labels, held_out.truth.numpy(), labels=[0, 1])),
            )
        logits = []
        for start in range(0, len(held_out), batch):
            dense, ids, _ = fetch(held_out, list(range(start, min(start + batch, len(held_out)))))
            logits.append(net(dense.to(device), ids.to(device)).float().cpu())
        scores = torch.cat(logits)
        probabilities = torch.sigmoid(scores).double().numpy()
        return {
            "loss": float(dlrm.sample_losses(scores, held_out.clicks).mean()),
            "auc": float(roc_auc_score(labels, probabilities)),
            **ceiling,
        }

    info = {
        "train_samples": len(train),
        "eval_samples": len(held_out),
        "table_rows": list(spec.rows),
        "click_rate": float(train.clicks.mean()),
    }
    return Workload(model, dlrm.per_sample_loss, train, evaluate, info=info, optimizer=recsys_optimizer(cfg, model))


def data_bytes(cfg: Config) -> int:
    """Host memory one rank's copy of the workload's data takes, where that can be large."""
    if cfg.model.name == "resnet":
        return shapes.data_bytes(cfg.model.samples, cfg.model.image_size)
    if cfg.model.name != "recsys":
        return 0
    return cfg.model.samples * (4 * clicks.DENSE + 8 * cfg.model.tables + 8)  # dense, ids, click and truth


def recsys_optimizer(cfg: Config, model: dlrm.DLRM) -> tuple[type, dict]:
    """`train.optimizer` for the dense layers, row-wise Adagrad at `train.table_lr` for the tables."""
    from gradmesh.optim import optimizer_spec, with_rowwise_tables
    from gradmesh.parallel.ps import sparse_tables

    base, kwargs = optimizer_spec(cfg.train)
    tables = [table for _, table in sparse_tables(model)]
    return with_rowwise_tables(base), {**kwargs, "tables": tables, "table_lr": cfg.train.table_lr}


BUILDERS = {
    "gpt-char": gpt_char,
    "mlp-digits": mlp_digits,
    "recsys": recsys,
    "resnet": resnet_shapes,
    **dict.fromkeys(HF_MODELS, hf_char),
}


def build(cfg: Config, device: torch.device, remote_tables: bool = False) -> Workload:
    """`remote_tables`: the strategy keeps sparse tables on parameter servers, which make their
    own rows (`model.init_rows`): the model's tables stay on the meta device, taking no memory."""
    if cfg.model.name == "recsys":
        return recsys(cfg, device, remote_tables)
    return BUILDERS[cfg.model.name](cfg, device)


class _MetaInitSkipped(TorchFunctionMode):
    """Initialisers (in-place ops) on meta tensors are skipped: a meta tensor has no values to set,
    and the first meta `normal_` imports torch._dynamo, which every launch's pre-flight checks would
    wait for (docs/benchmarks.md#launch)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name, target = getattr(func, "__name__", ""), args[0] if args else kwargs.get("tensor")  # nn.init's keyword
        if name.endswith("_") and not name.endswith("__") and isinstance(target, torch.Tensor) and target.is_meta:
            return target
        return func(*args, **kwargs)


def meta_model(cfg: Config) -> nn.Module:
    """The configured model on the meta device (no memory, no data): for checks before launch."""
    if cfg.model.name == "resnet":
        import torchvision  # noqa: F401 (outside the meta device: a tensor it makes at import is a real one)
    with torch.device("meta"), _MetaInitSkipped():
        if cfg.model.name in TEXT_MODELS:
            vocab_size = len(CharVocab.of(load_text(cfg.data.path, cfg.data.max_chars)).chars)
            if cfg.model.name in HF_MODELS:
                from gradmesh import hf

                return hf.build_model(cfg, vocab_size)
            return gpt.GPT(_gpt_config(cfg, vocab_size))
        if cfg.model.name == "recsys":
            return dlrm.DLRM(click_spec(cfg).rows, cfg.model.dim, clicks.DENSE, cfg.model.hidden, materialize=False)
        if cfg.model.name == "resnet":
            return resnet.resnet18(len(shapes.SHAPES), cfg.model.width)
        if cfg.model.name in RL_MODELS:
            return ActorCritic(hidden=cfg.model.hidden)
        return mlp.MLP(hidden=cfg.model.hidden)


def train_size(cfg: Config) -> int:
    """Samples in one pass over the configured training data."""
    data = build(cfg, torch.device("cpu")).train_data
    assert isinstance(data, Sized)  # the built-in workloads' datasets are map-style
    return len(data)


def model_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of the configured model."""
    return {name: tuple(t.shape) for name, t in meta_model(cfg).state_dict().items()}


def check_inputs(cfg: Config) -> None:
    """Fail fast (UsageError) on data problems before any worker starts."""
    if cfg.data.path and cfg.model.name not in TEXT_MODELS:  # silently training on other data would mislead
        raise UsageError(
            f"data.path {cfg.data.path!r}: {cfg.model.name} trains on its own built-in data; "
            f"--data is read by {', '.join(TEXT_MODELS)} only"
        )
    if cfg.model.name in TEXT_MODELS:
        text = load_text(cfg.data.path, cfg.data.max_chars)
        char_datasets(text, cfg.model.block_size, cfg.data.eval_fraction)


__all__ = ["CharVocab", "Workload", "build", "check_inputs"]

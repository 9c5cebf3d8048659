"""Hugging Face models as gradmesh workloads: `--model hf:gpt2` and `--model hf:llama`.

gpt-char's workload (its text, character vocabulary, held-out batches, per-sample loss and
sample) around a transformers model built from its config class (`gradmesh.models.hf`). The
`transformers` package is an optional extra (`pip install 'gradmesh[hf]'`): asking for an hf
model without it is a one-line UsageError, met before launch where the meta model is built.
"""

import torch
import torch.nn as nn

from gradmesh import env
from gradmesh.config import Config
from gradmesh.errors import UsageError
from gradmesh.models import gpt


def _models(name: str):
    """gradmesh.models.hf, with transformers importable and the hub switched off first."""
    env.hub_offline()
    try:
        import transformers  # noqa: F401
    except ImportError as err:
        raise UsageError(
            f"--model {name} needs the transformers package, which is not installed ({err}); "
            "install it with pip install 'gradmesh[hf]'"
        ) from None
    from gradmesh.models import hf

    return hf


def build_model(cfg: Config, vocab_size: int) -> nn.Module:
    """The configured hf model (freshly initialised), sized by model.n_layer, n_head, n_embd and
    block_size; dropout model.dropout (0 by default: parity)."""
    hf = _models(cfg.model.name)
    family = hf.FAMILIES[cfg.model.name.removeprefix("hf:")]
    model = cfg.model
    return family(
        vocab_size=vocab_size,
        block_size=model.block_size,
        n_layer=model.n_layer,
        n_head=model.n_head,
        n_embd=model.n_embd,
        dropout=model.dropout,
    )


def per_sample_loss(model: nn.Module, batch) -> torch.Tensor:
    """gpt-char's loss: the mean next-character cross-entropy of each sequence, [batch]."""
    from gradmesh.models import hf

    inputs, targets = batch
    return gpt.sample_losses(hf.logits(model, inputs), targets)


def sampler(cfg: Config):
    """(model, prompt, chars, generator) -> the prompt and `chars` characters sampled after it."""
    from gradmesh.models import hf

    def generate(model: nn.Module, prompt: torch.Tensor, chars: int, generator: torch.Generator) -> torch.Tensor:
        return hf.generate(model, prompt, chars, cfg.model.block_size, top_k=10, generator=generator)

    return generate

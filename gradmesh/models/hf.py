"""Hugging Face transformers causal language models, built from their config class alone.

No weights are loaded and nothing is fetched: `GPT2Config` / `LlamaConfig` are filled in from
gpt-char's size settings and the model class builds freshly initialised layers from them, as
`from_config` does. Plain PyTorch modules as transformers makes them; strategies are applied
from outside. `transformers` is imported on first use (it is an optional extra, `gradmesh[hf]`).

Choices made for gradmesh, each for a reason:
- the output embedding is not tied to the input one (GPT-2's default ties them): a tensor shared
  by two names cannot be written to safetensors, and gradmesh's own GPT does not tie either;
- no KV cache in training (`use_cache=False`): the cache is for generation and would be
  allocated and returned by every training forward;
- attention through torch's scaled_dot_product_attention, named, not detected;
- no bos/eos/pad token ids: the vocabulary is characters, GPT-2's 50256 would lie outside it;
- hf:llama's MLP is 4 x n_embd wide (gpt-char's), one key/value head per query head (no GQA).
"""

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


def gpt2(*, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int, dropout: float) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=block_size,
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        tie_word_embeddings=False,
        use_cache=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    config._attn_implementation = "sdpa"
    return GPT2LMHeadModel(config)


def llama(*, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int, dropout: float) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        max_position_embeddings=block_size,
        num_hidden_layers=n_layer,
        num_attention_heads=n_head,
        num_key_value_heads=n_head,
        hidden_size=n_embd,
        intermediate_size=4 * n_embd,
        attention_dropout=dropout,
        tie_word_embeddings=False,
        use_cache=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


FAMILIES: dict[str, Callable[..., nn.Module]] = {"gpt2": gpt2, "llama": llama}
"""A family's name (what follows `hf:`) -> the function that builds it from gpt-char's sizes."""


def logits(model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """The next-token scores, [batch, time, vocab] (a transformers model returns an output object)."""
    return model(input_ids=inputs).logits


@torch.no_grad()
def generate(
    model: nn.Module,
    idx: torch.Tensor,
    new_tokens: int,
    block_size: int,
    temperature: float = 0.8,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """gpt-char's sampling loop (top-k, temperature), not transformers' `generate`: the same
    sampling on both, drawn from an explicit generator."""
    for _ in range(new_tokens):
        scores = logits(model, idx[:, -block_size:])[:, -1, :] / temperature
        if top_k is not None:
            kth = torch.topk(scores, min(top_k, scores.size(-1))).values[:, [-1]]
            scores[scores < kth] = -float("inf")
        idx = torch.cat((idx, torch.multinomial(F.softmax(scores, dim=-1), 1, generator=generator)), dim=1)
    return idx

"""Tensor-parallel plans as data, and what is known of them before any process group exists:
which submodules of a model class are split by columns or rows, whether a degree divides the
model, how many parameters a plan splits. Apart from `gradmesh.parallel.tensor` (which applies
them through DTensor) so that a launch's checks do not import DTensor.
"""

from typing import cast

import torch.nn as nn

from gradmesh.errors import UsageError

# model class -> (the submodule holding the blocks, a dotted path; {submodule in a block: style})
TP_PLANS = {
    "GPT": (
        "h",
        {
            "attn.q_proj": "colwise",
            "attn.k_proj": "colwise",
            "attn.v_proj": "colwise",
            "attn.c_proj": "rowwise",
            "mlp.c_fc": "colwise",
            "mlp.c_proj": "rowwise",
        },
    ),
    # torchtitan's Llama plan: q, k, v and the SwiGLU's gate and up split by output columns (whole
    # heads per rank: transformers' LlamaAttention reshapes to (-1, head_dim), so it runs on the
    # heads it holds), o and down by input rows.
    "LlamaForCausalLM": (
        "model.layers",
        {
            "self_attn.q_proj": "colwise",
            "self_attn.k_proj": "colwise",
            "self_attn.v_proj": "colwise",
            "self_attn.o_proj": "rowwise",
            "mlp.gate_proj": "colwise",
            "mlp.up_proj": "colwise",
            "mlp.down_proj": "rowwise",
        },
    ),
}
TP_MODELS = ("gpt-char", "hf:llama")
"""The configured models (model.name) whose class has a plan above."""
TP_REFUSED = {
    "hf:gpt2": "transformers' GPT-2 computes q, k and v in one fused Conv1D (c_attn, its weight stored "
    "transposed), which DTensor's column and row styles cannot split by heads; use --model hf:llama or "
    "gpt-char for tensor parallelism, or ddp, zero1 or fsdp for hf:gpt2",
}
"""Models tensor parallelism refuses, and why."""


def check_tp_degree(model_name: str, n_head: int, n_embd: int, degree: int) -> None:
    """Before launch: the plan splits heads and the 4*n_embd hidden layer (both models') evenly."""
    if model_name in TP_REFUSED:
        raise UsageError(f"tensor parallelism has no plan for {model_name}: {TP_REFUSED[model_name]}")
    if model_name not in TP_MODELS:
        raise UsageError(f"tensor parallelism has a plan for {' and '.join(TP_MODELS)} only, not {model_name!r}")
    if n_head % degree:
        raise UsageError(
            f"tensor-parallel degree {degree} does not divide model.n_head={n_head}; use a degree dividing {n_head}"
        )
    if (4 * n_embd) % degree or n_embd % degree:
        raise UsageError(f"tensor-parallel degree {degree} does not divide model.n_embd={n_embd}")


def tp_parameter_count(model: nn.Module) -> int:
    """Parameters the plan splits (for the registry's formulas), on a plain or meta model."""
    if type(model).__name__ not in TP_PLANS:
        return 0
    blocks_attr, block_plan = TP_PLANS[type(model).__name__]
    return sum(
        p.numel()
        for block in cast(nn.ModuleList, model.get_submodule(blocks_attr))
        for path in block_plan
        for p in block.get_submodule(path).parameters()
    )

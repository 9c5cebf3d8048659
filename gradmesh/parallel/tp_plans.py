"""Tensor-parallel plans as data, and what is known of them before any process group exists:
which submodules of a model class are split by columns or rows, whether a degree divides the
model, how many parameters a plan splits. Apart from `gradmesh.parallel.tensor` (which applies
them through DTensor) so that a launch's checks do not import DTensor.
"""

import torch.nn as nn

from gradmesh.errors import UsageError

# model class -> (blocks attribute, {submodule in a block: style})
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
}


def check_tp_degree(model_name: str, n_head: int, n_embd: int, degree: int) -> None:
    """Before launch: the plan splits heads and the 4*n_embd hidden layer evenly."""
    if model_name != "gpt-char":
        raise UsageError(f"tensor parallelism has a plan for gpt-char only, not {model_name!r}")
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
        for block in getattr(model, blocks_attr)
        for path in block_plan
        for p in block.get_submodule(path).parameters()
    )

"""The registry's formulas against a real run: bytes the reducer counted and bytes each rank holds."""

from helpers import metrics, summary, weights

from gradmesh.parallel import registry


def test_ddp_bytes_on_the_wire_and_in_memory_match_the_registry(straggler_run):
    """A 2-rank ddp run (AdamW): every step each rank hands all P gradients (4P bytes) to the
    all-reduce, which a ring sends 2(N-1)/N times over; each rank holds 16P bytes of state, plus
    the one 4-byte step counter AdamW keeps per parameter tensor, which the formula leaves out."""
    run_dir = straggler_run["dir"]
    tensors = weights(run_dir)
    params = sum(t.numel() for t in tensors.values())
    ddp, size, n = registry.STRATEGIES["ddp"], registry.ModelSize(params=params), 2
    for row in metrics(run_dir):
        assert row["breakdown"]["comm_bytes"] == [4 * params] * n
        assert ddp.wire_bytes(size, n) == 2 * (n - 1) / n * row["breakdown"]["comm_bytes"][0]
    assert summary(run_dir)["model_state_bytes"] == [ddp.state_bytes(size, n) + 4 * len(tensors)] * n


def test_slot_count_is_what_the_optimizer_keeps():
    """The formulas' K (state tensors per parameter) against a real optimizer's state after a step
    on a real layer, for optimizers a class table would get wrong (amsgrad's third moment,
    Adagrad's sum, SGD without momentum keeping none)."""
    import torch

    from gradmesh.optim import optimizer_slots

    cases = [(torch.optim.AdamW, {}, 2), (torch.optim.Adam, {"amsgrad": True}, 3), (torch.optim.SGD, {}, 0),
             (torch.optim.SGD, {"momentum": 0.9}, 1), (torch.optim.Adagrad, {}, 1)]
    for optimizer_class, kwargs, expected in cases:
        layer = torch.nn.Linear(3, 2)
        optimizer = optimizer_class(layer.parameters(), lr=0.1, **kwargs)
        layer(torch.ones(1, 3)).sum().backward()
        optimizer.step()
        kept = [k for k, v in optimizer.state[layer.weight].items()
                if isinstance(v, torch.Tensor) and v.shape == layer.weight.shape]
        assert optimizer_slots(optimizer_class, kwargs) == len(kept) == expected, optimizer_class

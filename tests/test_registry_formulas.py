"""The registry's formulas against a real run: bytes the reducer counted and bytes each rank holds."""

from gradmesh.parallel import registry
from helpers import metrics, summary, weights


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

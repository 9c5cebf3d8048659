"""Synchronised batch normalisation (`gradmesh.parallel.batchnorm`) against plain BatchNorm on the
concatenated batch, with real gloo process groups: forward, backward, running statistics, uneven
shares and a rank that only pads."""

import multiprocessing
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from gradmesh.parallel.batchnorm import SyncBatchNorm, convert_sync_batchnorm, counting

TOLERANCE = dict(rtol=1e-5, atol=1e-6)
"""Summation order alone (float64 statistics, fp32 elementwise)."""


def _case(seed: int, samples: int, shape=(3, 4, 5)):
    """Inputs, an upstream gradient and a BatchNorm with non-trivial affine parameters and buffers."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, *shape, generator=generator) * 3 + 1.5
    upstream = torch.randn(samples, *shape, generator=generator)
    norm = nn.BatchNorm2d(shape[0]) if len(shape) == 3 else nn.BatchNorm1d(shape[0])
    with torch.no_grad():
        norm.weight.copy_(torch.rand(shape[0], generator=generator) + 0.5)
        norm.bias.copy_(torch.randn(shape[0], generator=generator))
        norm.running_mean.copy_(torch.randn(shape[0], generator=generator))
        norm.running_var.copy_(torch.rand(shape[0], generator=generator) + 0.5)
    return x, upstream, norm


def _run(norm: nn.Module, x: torch.Tensor, upstream: torch.Tensor, steps: int = 2) -> dict:
    """`steps` forwards and backwards (the running statistics move twice); the last step's results."""
    for _ in range(steps):
        norm.zero_grad()
        leaf = x.clone().requires_grad_()
        y = norm(leaf)
        (y * upstream).sum().backward()
    return {"y": y.detach(), "dx": leaf.grad, "dw": norm.weight.grad.clone(), "db": norm.bias.grad.clone(),
            "mean": norm.running_mean.clone(), "var": norm.running_var.clone(),
            "batches": int(norm.num_batches_tracked)}


def _reference(seed: int, samples: int, shape) -> dict:
    x, upstream, norm = _case(seed, samples, shape)
    return _run(norm, x, upstream)


def _rank(rank: int, store: str, cuts: list[int], seed: int, samples: int, shape, pads: bool, out) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
        x, upstream, norm = _case(seed, samples, shape)
        synced = convert_sync_batchnorm(norm)
        synced.group = dist.group.WORLD
        mine = slice(cuts[rank], cuts[rank + 1])
        padding = pads and cuts[rank] == cuts[rank + 1]
        if padding:  # no samples: one stand-in sample at weight 0, as the engine pads an empty share
            mine = slice(0, 1)
        with counting([synced], not padding):
            found = _run(synced, x[mine], upstream[mine] * (0 if padding else 1))
        for key in ("dw", "db"):  # what DDP's all-reduce adds up
            dist.all_reduce(found[key])
        out.put((rank, found, mine.start, mine.stop))
        dist.destroy_process_group()
    except Exception:
        out.put((rank, traceback.format_exc(), 0, 0))


def _two_ranks(tmp_path, cuts, seed, samples, shape, pads=False) -> dict:
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    store = tmp_path / f"store-{seed}"
    workers = [context.Process(target=_rank, args=(r, str(store), cuts, seed, samples, shape, pads, out))
               for r in range(2)]
    for w in workers:
        w.start()
    found = {}
    for _ in workers:
        rank, result, start, stop = out.get(timeout=60)
        assert isinstance(result, dict), result
        found[rank] = (result, start, stop)
    for w in workers:
        w.join(timeout=30)
    return found


@pytest.mark.parametrize("cuts, shape", [([0, 5, 7], (3, 4, 5)), ([0, 2, 9], (6,))],
                         ids=["2d uneven 5+2", "1d uneven 2+7"])
def test_two_ranks_equal_one_batchnorm_on_the_whole_batch(tmp_path, cuts, shape):
    samples = cuts[-1]
    reference = _reference(3, samples, shape)
    for found, start, stop in _two_ranks(tmp_path, cuts, 3, samples, shape).values():
        for key in ("y", "dx"):
            torch.testing.assert_close(found[key], reference[key][start:stop], **TOLERANCE)
        for key in ("dw", "db", "mean", "var"):  # every rank's running statistics: the same numbers
            torch.testing.assert_close(found[key], reference[key], **TOLERANCE)
        assert found["batches"] == reference["batches"] == 2


def test_a_rank_that_only_pads_counts_nothing(tmp_path):
    """Rank 1's share is empty: it runs a stand-in sample at weight 0, which must not move the
    statistics, the gradients, or rank 0's results."""
    reference = _reference(5, 6, (3, 4, 5))
    found = _two_ranks(tmp_path, [0, 6, 6], 5, 6, (3, 4, 5), pads=True)
    for key in ("y", "dx"):
        torch.testing.assert_close(found[0][0][key], reference[key], **TOLERANCE)
    for rank in (0, 1):
        for key in ("dw", "db", "mean", "var"):
            torch.testing.assert_close(found[rank][0][key], reference[key], **TOLERANCE)
    assert torch.count_nonzero(found[1][0]["dx"]) == 0


def test_unbound_it_is_batchnorm_and_eval_uses_the_running_statistics():
    x, upstream, norm = _case(7, 8, (3, 4, 5))
    reference = _run(norm, x, upstream)
    x, upstream, plain = _case(7, 8, (3, 4, 5))
    synced = convert_sync_batchnorm(nn.Sequential(plain))
    assert isinstance(synced[0], SyncBatchNorm) and synced[0].weight is plain.weight  # the same parameters
    found = _run(synced[0], x, upstream)
    for key in reference:
        if key != "batches":
            torch.testing.assert_close(found[key], reference[key], **TOLERANCE)
    norm.eval(), synced.eval()
    torch.testing.assert_close(synced(x), norm(x), **TOLERANCE)
    assert list(synced.state_dict()) == list(nn.Sequential(norm).state_dict())

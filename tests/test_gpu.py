"""Contract 2 on CUDA with NCCL: where a GPU exists, N ranks train the same model as one process.

Skipped on machines without CUDA (CI here has none); the `device` tool runs these on a GPU host.
One GPU is enough: ranks then share it (NCCL needs one rank per device, so the 2-rank case needs
two GPUs and is skipped on one)."""

import pytest
import torch

from helpers import rel_l2, train, weights

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")]
TOLERANCE = 1e-5
STEPS = ["--max-steps", "20", "--global-batch-size", "16", "--device", "cuda"]


def gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.fixture(scope="module")
def reference(catalogue):
    return {optimizer: weights(catalogue.run(1, *STEPS, "--optimizer", optimizer)) for optimizer in ("adamw", "sgd")}


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "fsdp"])
def test_nccl_matches_single_process(reference, tmp_path, strategy, optimizer):
    if gpus() < 2:
        pytest.skip("NCCL data parallelism needs two GPUs (one per rank)")
    train(tmp_path, 2, *STEPS, "--optimizer", optimizer, "--strategy", strategy)
    assert rel_l2(weights(tmp_path), reference[optimizer]) <= TOLERANCE


def test_one_rank_on_cuda_matches_one_rank_on_cpu(tmp_path):
    """The CUDA path at world size 1 (the same code path as N) against the CPU run."""
    args = ["--max-steps", "20", "--global-batch-size", "16", "--optimizer", "sgd"]
    train(tmp_path / "cuda", 1, *args, "--device", "cuda")
    train(tmp_path / "cpu", 1, *args, "--device", "cpu")
    assert rel_l2(weights(tmp_path / "cuda"), weights(tmp_path / "cpu")) <= 1e-4


@pytest.mark.parametrize("mode", ["sync", "ssp:0"])
def test_parameter_servers_on_nccl_match_single_process(reference, tmp_path, mode):
    """Payloads on NCCL (one rank per GPU), headers on gloo: 2 workers and a server need 3 GPUs."""
    if gpus() < 3:
        pytest.skip("a parameter server and two workers on NCCL need three GPUs (one per rank)")
    train(tmp_path, 3, *STEPS, "--optimizer", "adamw", "--strategy", "ps", "--ps-mode", mode)
    assert rel_l2(weights(tmp_path), reference["adamw"]) <= TOLERANCE

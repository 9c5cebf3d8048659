"""Tensor parallelism and 2-D meshes (issue 4, first part): parity with one process,
checkpoints that reshard between them and data-parallel strategies, and shapes that do not
fit refused before launch."""

import pytest

from helpers import references, gradmesh, rel_l2, train, weights

ARGS = ["--max-steps", "20", "--global-batch-size", "16", "--set", "model.n_head=4"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return references(tmp_path_factory, "tp-ref", *ARGS)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("nproc", [2, 4])
def test_tensor_parallel_matches_single_process(reference, tmp_path, nproc, optimizer):
    train(tmp_path, nproc, *ARGS, "--optimizer", optimizer, "--strategy", "tp")
    assert rel_l2(weights(tmp_path), reference[optimizer]) <= 1e-5


def test_tensor_parallel_checkpoint_resumes_under_fsdp(reference, tmp_path):
    first = [a if a != "20" else "10" for a in ARGS]
    train(tmp_path, 2, *first, "--optimizer", "adamw", "--strategy", "tp")
    train(tmp_path, 2, "--resume", "--strategy", "fsdp", "--max-steps", "20", "--set", "model.n_head=4")
    assert rel_l2(weights(tmp_path), reference["adamw"]) <= 1e-5


def test_degree_not_dividing_the_heads_is_refused(tmp_path):
    result = gradmesh("train", "--strategy", "tp", "--nproc", "4", "--set", "model.n_head=6",
                      "--set", "model.n_embd=48", "--run-dir", str(tmp_path), timeout=60)
    assert result.returncode == 2 and "does not divide model.n_head=6" in result.stderr
    result = gradmesh("train", "--strategy", "tp", "--nproc", "2", "--model", "mlp-digits",
                      "--run-dir", str(tmp_path), timeout=60)
    assert result.returncode == 2 and "gpt-char only" in result.stderr


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("mesh", ["dp=2,tp=2", "fsdp=2,tp=2"])
def test_two_dimensional_meshes_match_single_process(reference, tmp_path, mesh, optimizer):
    train(tmp_path, 4, *ARGS, "--optimizer", optimizer, "--mesh", mesh)
    assert rel_l2(weights(tmp_path), reference[optimizer]) <= 1e-5


def test_checkpoint_from_a_two_dimensional_mesh_resumes_under_ddp(reference, tmp_path):
    first = [a if a != "20" else "10" for a in ARGS]
    train(tmp_path, 4, *first, "--optimizer", "adamw", "--mesh", "fsdp=2,tp=2")
    train(tmp_path, 2, "--resume", "--mesh", "", "--strategy", "ddp", "--max-steps", "20", "--set", "model.n_head=4")
    assert rel_l2(weights(tmp_path), reference["adamw"]) <= 1e-5


@pytest.mark.parametrize("mesh, words", [("dp=2,tp=2", ["spans 4 ranks", "has 2"]),
                                         ("dp=2,xx=1", ["AXIS=N", "dp, fsdp, pp, tp"]),
                                         ("pp=1,tp=2", ["does not compose yet"])])
def test_bad_meshes_are_refused_before_launch(tmp_path, mesh, words):
    result = gradmesh("train", "--nproc", "2", "--mesh", mesh, "--run-dir", str(tmp_path), timeout=60)
    assert result.returncode == 2 and all(w in result.stderr for w in words), result.stderr

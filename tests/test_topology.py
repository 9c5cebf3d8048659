import pytest

from gradmesh.errors import UsageError
from gradmesh.topology import Topology, threads_per_worker


def topo(rank, world, mesh=None):
    return Topology(rank=rank, world_size=world, local_rank=rank, local_world_size=world,
                    device_type="cpu", mesh_shape=mesh or {})


def test_plain_data_parallel_rank_is_the_rank():
    assert [topo(r, 4).dp_rank for r in range(4)] == [0, 1, 2, 3]
    assert topo(0, 4).dp_size == 4 and topo(0, 4).mesh_shape == {"dp": 4}


def test_data_rank_on_a_two_dimensional_mesh_ignores_the_model_axes():
    # Row-major mesh dp=2 x tp=2: ranks 0,1 hold dp coordinate 0; ranks 2,3 coordinate 1.
    ranks = [topo(r, 4, {"dp": 2, "tp": 2}) for r in range(4)]
    assert [t.dp_rank for t in ranks] == [0, 0, 1, 1] and ranks[0].dp_size == 2
    ranks = [topo(r, 4, {"pp": 2, "dp": 2}) for r in range(4)]
    assert [t.dp_rank for t in ranks] == [0, 1, 0, 1]


def test_mesh_must_cover_the_world_and_use_known_axes():
    with pytest.raises(UsageError, match="world size is 4"):
        topo(0, 4, {"dp": 3})
    with pytest.raises(UsageError, match="unknown mesh axes"):
        topo(0, 4, {"xy": 4})


def test_threads_are_shared_between_local_workers(monkeypatch):
    import os
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = os.cpu_count()
    assert threads_per_worker(1) == cores
    assert threads_per_worker(cores * 2) == 1


def test_omp_num_threads_overrides_the_share(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads_per_worker(2) == 3

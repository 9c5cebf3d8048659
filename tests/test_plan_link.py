"""The link calibration (issue 27): the alpha-beta fit, its cache format, and a real 2-rank run."""

import json
import multiprocessing

import pytest

from gradmesh.plan import link
from gradmesh.plan.link import KIB, KINDS, MIB, LinkFit, LinkProfile, bytes_moved, fit_alpha_beta, measure_link


def test_the_fit_recovers_a_known_alpha_and_beta():
    alpha, beta = 35e-6, 0.8e-9  # 35 µs start-up, 1.25 GB/s
    points = [(x, alpha + x * beta) for x in (4 * KIB, 64 * KIB, 512 * KIB, 2 * MIB, 8 * MIB)]
    assert fit_alpha_beta(points) == pytest.approx((alpha, beta), rel=1e-9)


def test_the_fit_keeps_alpha_and_beta_non_negative():
    """Timings that fall with size would fit a negative beta, a steep trend a negative alpha."""
    falling = fit_alpha_beta([(1e3, 3e-4), (1e6, 2e-4), (4e6, 1e-4)])
    steep = fit_alpha_beta([(1e6, 1e-4), (2e6, 3e-4), (4e6, 7e-4)])
    assert falling[1] == 0 and falling[0] > 0
    assert steep[0] == 0 and steep[1] > 0


def test_ring_and_tree_bytes():
    assert bytes_moved("all_reduce", 1000, 4) == 1500
    assert bytes_moved("all_gather", 1000, 4) == bytes_moved("reduce_scatter", 1000, 4) == 750
    assert bytes_moved("broadcast", 1000, 5) == 3000  # ceil(log2 5) rounds of gloo's binomial tree
    assert bytes_moved("p2p", 1000, 8) == 1000
    with pytest.raises(ValueError, match="unknown communication kind"):
        bytes_moved("all_to_all", 1000, 2)


def test_a_profile_survives_its_json_cache():
    points = ((4096, 1.1e-4), (1 << 20, 1.3e-3))
    fits = {kind: LinkFit(1e-4 + i * 1e-5, 1e-9 / (i + 1), points) for i, kind in enumerate(KINDS)}
    profile = LinkProfile(world=2, backend="gloo", threads=1, fits=fits)
    assert LinkProfile.from_json(json.loads(json.dumps(profile.to_json()))) == profile
    with pytest.raises(ValueError, match="format"):
        LinkProfile.from_json({**profile.to_json(), "format": 0})
    with pytest.raises(ValueError, match="not a link calibration"):
        LinkProfile.from_json({"format": 1, "world": 2})


def test_one_rank_spawns_nothing_and_predicts_zero(monkeypatch):
    def no_processes(*args, **kwargs):
        raise AssertionError("one rank must not spawn processes")

    monkeypatch.setattr(link.multiprocessing, "get_context", no_processes)
    profile = measure_link(1)
    assert [profile.predict(kind, 64 * MIB) for kind in KINDS] == [0.0] * len(KINDS)
    assert LinkProfile.from_json(profile.to_json()) == profile


def test_the_fit_predicts_a_size_it_was_not_fitted_to():
    """Two real gloo ranks on loopback. all_reduce of 3 MiB is timed in the same run as the
    calibration sizes around it, interleaved with them, but left out of the fit; the fit's
    prediction must be within 30% of its timing.

    In the same run, not a second one: on a shared machine the load drifts between runs and moved
    a separately timed size by up to 2x, which would test the neighbours, not the model. 30%: on 2
    cores at load 3-8 from other jobs, each point the lower quartile of 15 calls, the prediction
    was within 10% in most of 30 runs and 25% at worst; a model off in kind (no start-up term, a
    wrong slope) misses 3 MiB by more."""
    held_out = 3 * MIB
    sizes = (64 * KIB, 256 * KIB, 1 * MIB, 2 * MIB, held_out, 4 * MIB, 6 * MIB)
    for attempt in range(2):  # a second run where the first missed: a neighbour's burst (once 4 MiB
        # took twice 3 MiB's time in a CI run) must miss twice to fail it; a wrong model misses every run
        profile = measure_link(2, sizes=sizes, repeats=15)
        assert not multiprocessing.active_children()
        assert set(profile.fits) == set(KINDS)
        assert all(f.beta_s_per_byte > 0 and len(f.points) == len(sizes) for f in profile.fits.values())

        points = profile.fits["all_reduce"].points
        measured = dict(points)[held_out]
        alpha, beta = fit_alpha_beta([(bytes_moved("all_reduce", b, 2), t) for b, t in points if b != held_out])
        predicted = alpha + bytes_moved("all_reduce", held_out, 2) * beta
        if predicted == pytest.approx(measured, rel=0.3):
            break
    assert predicted == pytest.approx(measured, rel=0.3), (points, alpha, beta)


def test_a_calibration_past_its_timeout_kills_its_ranks():
    with pytest.raises(TimeoutError, match="ranks killed"):
        measure_link(2, timeout_s=0.2)
    assert not multiprocessing.active_children()

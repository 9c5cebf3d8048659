"""The planner: its cost rows against their formulas, its candidates against `gradmesh train`'s own
checks, its cache, its command's input handling, and its predictions against measured runs."""

import json

import pytest

from gradmesh.config import build
from gradmesh.parallel import registry
from gradmesh.plan import costs
from gradmesh.plan.candidates import Candidate, candidates
from gradmesh.plan.compute import ComputeProfile
from gradmesh.plan.link import LinkFit, LinkProfile
from gradmesh.plan.planner import Calibration

PROFILE = ComputeProfile(threads=1, fixed_s=0.01, per_sample_s=0.002, optimizer_s_per_param=1e-8,
                         add_s_per_param=1e-9, activation_bytes_per_sample=1000.0, params=1_000_000,
                         base_bytes=300 * 2**20, boundary_bytes_per_sample=4096.0, layers=4)
ALPHA, BETA = 1e-4, 1e-9


def _calibration() -> Calibration:
    fit = LinkFit(ALPHA, BETA)
    link = LinkProfile(2, "gloo", 1, {kind: fit for kind in ("all_reduce", "all_gather", "reduce_scatter",
                                                              "broadcast", "p2p")})
    return Calibration({1: PROFILE}, {2: link}, {"loop": 0.001})


def _step(**options) -> costs.Step:
    return costs.Step(compute=PROFILE, network=_calibration(), options=costs.Options(**options),
                      micro_samples=16, micro=1, params=PROFILE.params)


def test_ddp_row_is_a_bucketed_ring_all_reduce_and_a_whole_optimizer_step():
    """Hockney's alpha-beta with ring bytes (Thakur et al., 2005): one alpha per 25 MiB bucket,
    2(N-1)/N x 4P bytes over the link."""
    step = _step()
    costs.ddp(step, 2)
    assert step.parts["comm"] == pytest.approx(ALPHA + 2 * (2 - 1) / 2 * 4 * PROFILE.params * BETA)
    assert step.parts["optimizer"] == pytest.approx(PROFILE.params * 1e-8)


def test_synchronised_batch_norm_adds_two_small_all_reduces_per_layer_and_micro_batch():
    """Each layer: count + 2C float64 sums forward, 2C backward, ring bytes 2(N-1)/N of them."""
    plain, normed = _step(), _step(norm_layers=3, norm_channels=40)
    normed.micro = 2
    costs.ddp(plain, 2)
    costs.ddp(normed, 2)
    extra = 2 * (6 * ALPHA + 2 * (2 - 1) / 2 * 8 * (4 * 40 + 3) * BETA)
    assert normed.parts["comm"] - plain.parts["comm"] == pytest.approx(extra)
    alone = _step(norm_layers=3, norm_channels=40)
    costs.ddp(alone, 1)
    assert alone.parts["comm"] == pytest.approx(0.0, abs=1e-12)  # one rank: no collective


def test_sharded_rows_step_a_share_and_move_more_bytes_than_ddp():
    ddp, zero1, fsdp = _step(), _step(), _step()
    costs.ddp(ddp, 2)
    costs.zero1(zero1, 2)
    costs.fsdp(fsdp, 2)
    assert zero1.parts["optimizer"] == fsdp.parts["optimizer"] == pytest.approx(ddp.parts["optimizer"] / 2)
    assert zero1.parts["comm"] > ddp.parts["comm"] and fsdp.parts["comm"] > ddp.parts["comm"]


def test_fsdp_row_gathers_each_unit_forward_and_all_but_the_root_backward():
    """FSDP2 keeps the root unit gathered from forward to backward; the gradients are
    reduce-scattered once per unit. 3 units (2 blocks and the root, which holds a quarter of the
    parameters), 2 micro-batches, 2 ranks: all-gathers move (N-1)/N x 4P per pass."""
    step = _step(fsdp_units=3, fsdp_root_share=0.25)
    step.micro = 2
    costs.fsdp(step, 2)
    forward = 3 * ALPHA + 0.5 * 4 * PROFILE.params * BETA
    backward = 2 * ALPHA + 0.5 * 4 * PROFILE.params * 0.75 * BETA
    scatter = 3 * ALPHA + 0.5 * 4 * PROFILE.params * BETA
    assert step.parts["comm"] == pytest.approx(2 * (forward + backward) + scatter)
    alone = _step(fsdp_units=1, fsdp_root_share=1.0)  # a model of one unit gathers once per pass
    costs.fsdp(alone, 2)
    assert alone.parts["comm"] == pytest.approx((ALPHA + 0.5 * 4 * PROFILE.params * BETA) * 2)


def test_fsdp_units_follow_the_sharding_plan():
    """A block per unit where the blocks hold at least a unit's bytes (GPT-2 small's width: 28 MB
    a block); below that (the default 4 x 128 GPT: 3 MB in all) the blocks stay in the root."""
    from gradmesh import workloads
    from gradmesh.parallel.sharded import UNIT_BYTES, fsdp_units

    gpt = workloads.meta_model(build([{"model": {"name": "gpt-char", "n_layer": 3, "n_embd": 768, "n_head": 12}}]))
    units, root = fsdp_units(gpt)
    blocks = sum(p.numel() for p in gpt.h.parameters())
    assert 4 * blocks >= UNIT_BYTES and units == 4 and root == sum(p.numel() for p in gpt.parameters()) - blocks > 0
    small = workloads.meta_model(build([{"model": {"name": "gpt-char", "n_layer": 4}}]))
    assert 4 * sum(p.numel() for p in small.h.parameters()) < UNIT_BYTES
    assert fsdp_units(small) == (1, sum(p.numel() for p in small.parameters()))
    assert fsdp_units(workloads.meta_model(build([{"model": {"name": "mlp-digits"}}])))[0] == 1


def test_pipeline_row_adds_the_fill_and_drain_of_its_stages():
    """GPipe's bubble: (S - 1) ticks of one micro-batch's stage time, beside M ticks of work."""
    step = _step(microbatches=8)
    costs.pipeline(step, 4)
    tick = (PROFILE.fixed_s + PROFILE.per_sample_s * 16 / 8) / 4
    assert step.pass_s() == pytest.approx(tick)
    assert step.parts["bubble"] == pytest.approx(3 * tick)
    assert step.micro == 8 and step.params == PROFILE.params / 4


def test_one_rank_moves_nothing():
    step = _step()
    costs.ddp(step, 1)
    assert step.parts["comm"] == 0.0


def test_every_candidate_passes_the_checks_train_makes_and_the_refused_say_why():
    cfg = build([])
    allowed, refused = candidates(cfg, 2, 2)
    strategies = {c.strategy for c, _ in allowed}
    assert {"ddp", "zero1", "fsdp", "tp", "pipeline", "ps"} <= strategies
    assert any(c.compression != "none" for c, _ in allowed) and any(c.grad_accum > 1 for c, _ in allowed)
    reasons = dict((c.strategy, why) for c, why in refused)
    assert "sparse embedding tables" in reasons["hybrid"]  # gpt-char has none
    assert len({c for c, _ in allowed}) == len(allowed)


def test_a_batch_norm_model_is_offered_no_accumulation():
    """Accumulation would normalise each micro-batch on its own: a different model, not a faster one."""
    allowed, _ = candidates(build([{"model": {"name": "resnet"}}]), 2, 2)
    assert allowed and {c.strategy for c, _ in allowed} <= {"ddp", "zero1", "fsdp"}
    assert all(c.grad_accum == 1 for c, _ in allowed)


def test_compressed_gradients_cost_their_wire_bytes_and_calls():
    from gradmesh.plan.predict import wire_of

    shapes = {"w": (256, 256), "b": (256,)}
    assert wire_of("none", shapes) == (4, 1)
    assert wire_of("fp16", shapes) == (2, 1)
    params = 256 * 256 + 256
    # PowerSGD: P (256 x 4) and Q (256 x 4) of the matrix, the bias as a plain mean: three calls.
    per_param, calls = wire_of("powersgd:rank=4", shapes)
    assert per_param == pytest.approx((4 * (256 + 256) * 4 + 4 * 256) / params) and calls == 3
    assert wire_of("powersgd:rank=4", {"w": (256, 256)})[1] == 2  # no plain tensor, no plain call
    assert wire_of("topk:ratio=0.01", shapes)[1] == 2  # the bias's mean and one all-gather


def test_compression_arithmetic_is_timed_per_method_on_the_model_shapes():
    from gradmesh.plan.arithmetic import measure_compression

    shapes = {"w": (512, 512), "b": (512,)}
    found = measure_compression(shapes, ["none", "fp16", "powersgd:rank=4"], threads=1)
    assert set(found) == {"compress:fp16", "compress:powersgd"}
    # A rank-4 PowerSGD step multiplies the 512 x 512 matrix twice and forms its error: more work
    # than narrowing and widening a copy of it.
    assert found["compress:powersgd"] > found["compress:fp16"] >= 0


def test_calibration_round_trips_through_json():
    found = _calibration()
    assert Calibration.from_json(json.loads(json.dumps(found.to_json()))) == found


def test_a_group_size_not_calibrated_takes_the_nearest_ones_link():
    """Four ranks from a 2-rank calibration: the same per-byte time, ring latency x (4-1)/(2-1)."""
    net = _calibration()
    assert net.time("all_reduce", 4e6, 4) == pytest.approx(3 * ALPHA + 2 * 3 / 4 * 4e6 * BETA)


def test_candidate_flags_are_what_train_takes():
    c = Candidate("ddp", compression="fp16", grad_accum=2)
    assert c.label == "--strategy ddp --compression fp16 --grad-accum 2"
    cfg = c.configured(build([]))
    assert (cfg.train.strategy, cfg.train.compression, cfg.train.grad_accum) == ("ddp", "fp16", 2)
    assert registry.resolve(cfg.train.strategy, {"dp": 2}).label == "ddp"


@pytest.mark.parametrize("trial_fails", [True, False])
def test_a_calibration_with_a_failed_trial_says_so_and_is_not_cached(monkeypatch, tmp_path, capsys, trial_fails):
    """A cached calibration whose ddp, ps and hybrid trials had failed left those overheads out
    for good: recsys plans then put hybrid 2x ahead of tables, which measured 2x behind it."""
    import os
    import sys

    from gradmesh.plan import overhead, planner

    def measure(cfg, machine, sizes, groups):
        if trial_fails:  # a real run that fails, through the trials' own runner
            broke = [sys.executable, "-c", "import sys; sys.exit('the trial broke')"]
            assert overhead._run(broke, dict(os.environ), "--strategy ddp on 2 worker(s)") is None
        return Calibration({}, {}, {"loop": 0.001})

    monkeypatch.setattr(planner, "_measure", measure)
    monkeypatch.setattr(planner, "calibration_place", lambda cfg, machine: ((1,), [2], tmp_path / "cal.json"))
    found, path, from_cache = planner.calibrate(None, None)
    assert found.overheads == {"loop": 0.001} and not from_cache
    err = capsys.readouterr().err
    if trial_fails:
        assert not path.exists()
        assert "a calibration run failed (left out, and nothing cached): --strategy ddp on 2 worker(s): exit 1: the trial broke" in err
    else:
        assert json.loads(path.read_text())["overheads"] == {"loop": 0.001} and err == ""

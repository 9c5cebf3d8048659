"""The test harness's run catalogue: which argument lists name the same run, that each is
trained once, and that a test writing into a shared run is noticed (no real training here)."""

import pytest

from catalogue import Catalogue, copy_run, normalise


def test_flag_and_set_order_do_not_matter():
    a = ("--max-steps", "20", "--set", "train.lr=0.01", "--record-samples", "--set", "model.n_head=4")
    b = ("--set", "model.n_head=4", "--record-samples", "--set", "train.lr=0.01", "--max-steps", "20")
    assert normalise(2, a) == normalise(2, b)


def test_different_values_world_sizes_or_models_are_different_runs():
    base = ("--max-steps", "20", "--optimizer", "sgd")
    assert normalise(2, base) != normalise(4, base)
    assert normalise(2, base) != normalise(2, ("--max-steps", "20", "--optimizer", "adamw"))
    assert normalise(2, base) != normalise(2, base + ("--record-samples",))
    assert normalise(2, base, tiny=True) != normalise(2, base, tiny=False)


def test_a_later_value_wins_as_in_gradmesh():
    """TINY sets model.n_layer=2; a test's own --set overrides it, as gradmesh's parser does."""
    assert normalise(1, ("--set", "model.n_layer=4")) != normalise(1, ())
    assert normalise(1, ("--strategy", "ddp", "--strategy", "tp")) == normalise(1, ("--strategy", "tp"))
    assert normalise(1, ("--set", "a.b=1", "--set", "a.b=2")) != normalise(1, ("--set", "a.b=2", "--set", "a.b=1"))


def test_injections_accumulate_in_any_order():
    one, two = ("--inject", "kill:rank=1,step=7"), ("--inject", "kill:rank=0,step=13")
    assert normalise(2, one + two) == normalise(2, two + one) != normalise(2, one)


def test_an_empty_value_is_a_value():
    assert normalise(2, ("--mesh", "", "--max-steps", "3")) != normalise(2, ("--mesh", "--max-steps", "3"))


def fake_catalogue(tmp_path, calls):
    def trainer(run_dir, nproc, *args, tiny=True):
        calls.append((nproc, args))
        assert "--broken" not in args, "gradmesh train failed"
        run_dir.mkdir(parents=True)
        (run_dir / "model.safetensors").write_text(repr((nproc, args)))

    return Catalogue(tmp_path / "catalogue", trainer=trainer)


def test_each_run_is_trained_once_whatever_the_order_of_its_arguments(tmp_path):
    calls = []
    catalogue = fake_catalogue(tmp_path, calls)
    first = catalogue.run(2, "--max-steps", "20", "--record-samples")
    assert catalogue.run(2, "--record-samples", "--max-steps", "20") == first
    assert catalogue.run(1, "--max-steps", "20", "--record-samples") != first
    assert len(calls) == len(catalogue) == 2


def test_writing_into_a_catalogued_run_is_noticed_and_a_copy_is_not(tmp_path):
    catalogue = fake_catalogue(tmp_path, [])
    run = catalogue.run(2, "--max-steps", "20")
    (copy_run(run, tmp_path / "copy") / "model.safetensors").write_text("resumed")
    assert catalogue.changed() == []
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "extra").write_text("")
    assert catalogue.changed() == [run]


def test_a_failed_run_is_not_retrained_for_every_test_that_needs_it(tmp_path):
    calls = []
    catalogue = fake_catalogue(tmp_path, calls)
    for _ in range(2):
        with pytest.raises(AssertionError, match="gradmesh train failed"):
            catalogue.run(2, "--broken")
    assert len(calls) == 1

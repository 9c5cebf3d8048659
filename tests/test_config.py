import pytest

from gradmesh import config
from gradmesh.errors import UsageError


def test_defaults_are_valid_and_round_trip_through_toml(tmp_path):
    cfg = config.build([])
    path = tmp_path / "c.toml"
    path.write_text(cfg.to_toml())
    assert config.build([config.load_toml(path)]) == cfg


def test_layers_later_wins_and_set_values_are_coerced():
    cfg = config.build([{"model": {"n_layer": 3}},
                        config.parse_sets(["model.n_layer=8", "train.lr=0.01", "train.record_samples=true"])])
    assert cfg.model.n_layer == 8 and cfg.train.lr == 0.01 and cfg.train.record_samples is True


@pytest.mark.parametrize("layer, words", [
    ({"model": {"name": "vgg"}}, ["vgg", "gpt-char", "mlp-digits", "resnet"]),
    ({"train": {"optimizer": "adam"}}, ["adam", "adamw", "sgd"]),
    ({"model": {"n_head": 3}}, ["n_head=3", "n_embd=128"]),
    ({"train": {"max_steps": 0}}, ["max_steps", ">= 1"]),
    ({"bogus": {}}, ["bogus", "model"]),
    ({"train": {"bogus": 1}}, ["train.bogus", "train.lr"]),
    ({"train": {"lr": "fast"}}, ["fast", "float"]),
])
def test_bad_values_name_the_problem_and_the_accepted_values(layer, words):
    with pytest.raises(UsageError) as err:
        config.build([layer])
    for word in words:
        assert word in str(err.value)


def test_set_rejects_unknown_keys_and_malformed_items():
    with pytest.raises(UsageError, match="model.depth"):
        config.parse_sets(["model.depth=3"])
    with pytest.raises(UsageError, match="section.key=value"):
        config.parse_sets(["n_layer"])


def test_global_batch_must_divide_over_ranks_and_micro_batches():
    cfg = config.build([{"train": {"global_batch_size": 30, "grad_accum": 2}}])
    cfg.check_world(3)  # 30 = 3 ranks x 2 micro-batches x 5
    with pytest.raises(UsageError, match="multiple of 8"):
        cfg.check_world(4)


def test_malformed_toml_is_a_usage_error(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[model\nn_layer = 2\n")
    with pytest.raises(UsageError, match="not valid TOML"):
        config.load_toml(path)

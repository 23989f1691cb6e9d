"""The config schema is the one source of keys and defaults: every shipped config holds exactly its
keys, a typo is refused by name, and groups built from it are independent."""

from __future__ import annotations

import importlib.util

import pytest

from tests.train_runs import ROOT
from valen_jax.config.schema import ARCHITECTURE_KEYS, REQUIRED, ConfigError, defaults, validate_config

CONFIGS = ("vflash", "valen", "chat", "vakforge", "prepared")


def _config(name: str, variant: str = ""):
    spec = importlib.util.spec_from_file_location(f"{name}_schema_cfg", ROOT / f"configs/{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(variant)


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("variant", ["", "tiny", "hf"])
def test_every_shipped_config_holds_exactly_the_schema_keys(name, variant):
    config = _config(name, variant)
    validate_config(config)
    assert {group: set(config[group]) for group in REQUIRED} == {g: set(keys) for g, keys in REQUIRED.items()}
    if variant == "hf":
        # The checkpoint fixes the architecture: the variant unsets exactly the schema's architecture keys.
        unset = [k for k in REQUIRED["model"] if config.model[k] is None and k not in ("init_from", "vision", "lora")]
        assert unset == list(ARCHITECTURE_KEYS)


@pytest.mark.parametrize(("group", "key"), [("data", "seq_length"), ("train", "learning_rat"), ("model.vision", "depth")])
def test_a_misspelt_key_is_refused_by_name(group, key):
    config = _config("valen", "tiny")
    target = config
    for part in group.split("."):
        target = target[part]
    with config.unlocked():
        target[key] = 1
    with pytest.raises(ConfigError, match=f"config.{group} has unknown keys {key}"):
        validate_config(config)


def test_a_missing_key_or_group_is_refused_by_name():
    config = _config("chat", "tiny")
    with config.unlocked():
        del config.loss["z_loss"]
    with pytest.raises(ConfigError, match="config.loss lacks z_loss"):
        validate_config(config)
    config = _config("chat", "tiny")
    with config.unlocked():
        config.optimiser = {"lr": 1.0}
    with pytest.raises(ConfigError, match="unknown groups optimiser"):
        validate_config(config)


def test_groups_from_the_schema_need_their_undefaulted_keys_and_are_independent():
    with pytest.raises(ConfigError, match="config.data: format, train, eval, eval_format, tokenizer, seq_len, "
                                          "max_patches must be given"):
        defaults("data")
    with pytest.raises(ConfigError, match="config.mesh has no key pipeline"):
        defaults("mesh", pipeline=2)
    # Placeholders are made per group: setting one config's peak_flops leaves another's unset.
    first, second = defaults("train"), defaults("train")
    first.peak_flops = 1e12
    assert second.peak_flops is None


@pytest.mark.parametrize(("sigma", "final", "match"), [
    (-1.0, None, "coordinate_sigma must be ≥ 0"),
    (float("nan"), None, "coordinate_sigma must be a finite number"),
    (0.0, 3.0, "needs both it and config.loss.coordinate_sigma"),
    (30.0, 0.0, "needs both it and config.loss.coordinate_sigma"),
])
def test_a_coordinate_sigma_that_cannot_be_annealed_is_refused(sigma, final, match):
    config = _config("vflash", "tiny")
    config.loss.coordinate_sigma = sigma
    config.loss.coordinate_sigma_final = final
    with pytest.raises(ConfigError, match=match):
        validate_config(config)


def test_coordinate_sigma_schedule_is_geometric_and_held_after_the_run():
    from valen_jax.training.step import StepOptions

    config = _config("vflash", "tiny")
    config.loss.coordinate_sigma, config.loss.coordinate_sigma_final, config.train.steps = 40.0, 10.0, 100
    validate_config(config)
    with pytest.raises(ValueError, match="needs the tokenizer"):
        StepOptions.from_config(config)
    options = StepOptions(coordinate_ids=(1, 2), coordinate_sigma=40.0, coordinate_sigma_final=10.0,
                          coordinate_sigma_steps=100)
    assert [round(float(options.sigma_at(s)), 4) for s in (0, 50, 100, 200)] == [40.0, 20.0, 10.0, 10.0]
    assert float(StepOptions(coordinate_ids=(1,), coordinate_sigma=5.0).sigma_at(77)) == 5.0


def test_coordinate_embeddings_are_a_fresh_model_option():
    config = _config("vflash", "tiny")
    config.model.coordinate_embeddings = "sinusoid"
    with pytest.raises(ConfigError, match="choose one of random, fourier"):
        validate_config(config)
    config = _config("vflash", "hf")
    validate_config(config)
    assert config.model.coordinate_embeddings == "random"
    config.model.init_from, config.model.coordinate_embeddings = "org/model", "fourier"
    with pytest.raises(ConfigError, match="the checkpoint's rows are kept"):
        validate_config(config)

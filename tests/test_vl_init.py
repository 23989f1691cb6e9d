"""`config.model.init_from` with a Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoint imports the whole VLM:
the run's model equals `hf.from_pretrained`'s (the added-token rows by `hf.extend_rows`), a tokenizer
with other vision ids or a vision key set next to it is refused, and `vision/.*` freezes the tower."""

from __future__ import annotations

import importlib.util
import json
import logging

import jax
import numpy as np
import pytest
from flax import nnx
from transformers import AutoTokenizer

pytest.importorskip("torch")

from data_pipeline.tokenizer import load_tokenizer  # noqa: E402
from tests.train_runs import ROOT  # noqa: E402
from tests.vl_checkpoints import FAMILIES  # noqa: E402
from valen_jax.config.schema import ConfigError, validate_config  # noqa: E402
from valen_jax.models import (  # noqa: E402
    build,
    hf,
    sharding,  # noqa: E402
)
from valen_jax.models.transformer import abstract_model  # noqa: E402
from valen_jax.training import optim


def _config(directory, tokenizer=None, variant="hf"):
    spec = importlib.util.spec_from_file_location("vflash_vl_init_cfg", ROOT / "configs/vflash.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config(variant)
    config.model.init_from = str(directory)
    config.data.tokenizer = str(tokenizer or directory)
    validate_config(config)
    return config


def _shardings(model_cfg):
    mesh = sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    return nnx.to_pure_dict(sharding.state_shardings(abstract_model(model_cfg)[1], mesh))


def _host(tree):
    return jax.tree.map(lambda a: np.asarray(jax.device_get(a)), tree)


@pytest.mark.slow  # ~20 s each here: the whole model's init compiles before the checkpoint replaces it
@pytest.mark.parametrize("family", FAMILIES)
def test_init_from_a_vl_checkpoint_imports_the_whole_model(vl_checkpoint, family, caplog):
    directory, info = vl_checkpoint(family)
    config = _config(directory)
    tokenizer = load_tokenizer(directory, "chatml")
    with caplog.at_level(logging.WARNING, logger="valen_jax.models.build"):
        model_cfg = build.model_config(config, tokenizer)
    reference, ref_cfg = hf.from_pretrained(directory)
    assert model_cfg.vision == ref_cfg.vision and model_cfg.vision.family == family
    assert (model_cfg.mrope_section, model_cfg.mrope_interleaved) == (ref_cfg.mrope_section, ref_cfg.mrope_interleaved)
    assert (model_cfg.image_pad_id, model_cfg.video_pad_id) == (info["image_token_id"], info["video_token_id"])
    assert (model_cfg.dtype, model_cfg.remat) == ("bfloat16", "full")  # the run's settings, not the checkpoint's
    # 404 checkpoint rows + 1024 added primitive tokens, padded to a multiple of 128.
    assert len(tokenizer) == info["vocab_size"] + 1024 and model_cfg.vocab_size == 1536
    # The :hf variant scans layers; Qwen3-VL's deepstack cannot be scanned, so its run unrolls them, saying so.
    deepstack = family == "qwen3_vl"
    assert model_cfg.scan_layers is not deepstack
    assert ("scan_layers=True is turned off" in caplog.text) is deepstack

    ours = _host(build.initial_params(config, model_cfg, tokenizer, _shardings(model_cfg)))
    expected = _host(nnx.to_pure_dict(nnx.state(reference, nnx.Param)))
    pieces = hf.added_token_pieces(AutoTokenizer.from_pretrained(str(directory)), tokenizer)
    assert sorted(pieces) == list(range(info["vocab_size"], len(tokenizer)))
    np.testing.assert_array_equal(ours.pop("embed"), hf.extend_rows(expected.pop("embed"), 1536, pieces))
    ours_layers, expected_layers = ours.pop("layers"), expected.pop("layers")
    for i in range(ref_cfg.num_layers):
        layer = jax.tree.map(lambda a, i=i: a[i], ours_layers) if model_cfg.scan_layers else ours_layers[i]
        jax.tree.map(np.testing.assert_array_equal, layer, expected_layers[i])
    # Everything else, the whole vision tower included, is the checkpoint's, unchanged.
    assert jax.tree.structure(ours) == jax.tree.structure(expected)
    jax.tree.map(np.testing.assert_array_equal, ours, expected)


def test_a_tokenizer_with_other_vision_ids_is_refused(vl_checkpoint):
    directory, info = vl_checkpoint("qwen2_5_vl")
    other = ROOT / "data/tokenizer"  # the smoke tokenizer: its <|image_pad|> is another id
    config = _config(directory, tokenizer=other)
    tokenizer = load_tokenizer(other, "chatml")
    assert tokenizer.convert_tokens_to_ids("<|image_pad|>") != info["image_token_id"]
    with pytest.raises(ConfigError, match=r"config.data.tokenizer=.* is not the tokenizer of config.model.init_from="
                                          rf".*<\|image_pad\|> is \d+ there but image_token_id={info['image_token_id']} "
                                          "in the checkpoint"):
        build.model_config(config, tokenizer)


def test_a_vision_key_next_to_a_vl_checkpoint_is_refused(vl_checkpoint):
    directory, _ = vl_checkpoint("qwen2_5_vl")
    config = _config(directory)
    config.model.vision.dim = 32
    config.model.vision.patch_size = 14
    with pytest.raises(ConfigError, match=r"qwen2_5_vl vision-language checkpoint, so config.model.vision."
                                          r"\{dim, patch_size\} come from the checkpoint"):
        build.model_config(config, load_tokenizer(directory, "chatml"))


def test_a_fresh_tower_takes_the_set_keys_and_the_schema_defaults_for_the_unset_ones():
    # The tower of a model trained from scratch (a text checkpoint gets none: tests/test_own_data.py).
    config = _config("unused")
    config.model.vision.dim = 32
    vision = build._fresh_vision(config.model.vision)
    assert (vision.dim, vision.patch_size, vision.num_layers, vision.family) == (32, 8, 2, "valen")


def test_vision_pattern_freezes_exactly_the_imported_tower(vl_checkpoint):
    directory, _ = vl_checkpoint("qwen3_vl")  # the tower with every kind of parameter (deepstack mergers too)
    config = _config(directory)
    model_cfg = build.model_config(config, load_tokenizer(directory, "chatml"))
    params = nnx.to_pure_dict(abstract_model(model_cfg)[1])
    mask = optim.frozen_mask(params, [{"pattern": "vision/.*", "frozen": True}])
    frozen = {optim.path_of(p) for p, leaf in jax.tree_util.tree_leaves_with_path(mask) if leaf}
    paths = {optim.path_of(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)}
    vision = {p for p in paths if p.startswith("vision/")}
    assert frozen == vision and len(vision) > 20 and {"embed", "final_norm/scale"} <= paths - frozen
    assert "vision/deepstack/0/fc1" in frozen and "vision/patch_embed" in frozen
    # Patterns match the WHOLE path: an anchored prefix matches nothing, and that is an error, not a no-op.
    with pytest.raises(optim.ParamGroupError, match="matches no parameter"):
        optim.frozen_mask(params, [{"pattern": "^vision/", "frozen": True}])


def test_export_states_the_runs_media_kwargs_so_the_next_run_reads_them_back(vl_checkpoint, tmp_path):
    """The processor files `valen_jax.export` writes give back every media_kwargs key of the run (a
    user override included) and the tower's patch geometry, as `init_from` would read them."""
    from valen_jax import export
    from valen_jax.data import vision_processor

    directory, _ = vl_checkpoint("qwen3_vl")
    model_cfg = build.model_config(_config(directory), load_tokenizer(directory, "chatml"))
    media_kwargs, _ = vision_processor.resolve_media_kwargs({"max_frames": 3, "image_std": (0.2, 0.3, 0.4)},
                                                            directory)
    for name, settings in export.processor_files(model_cfg, media_kwargs).items():
        (tmp_path / name).write_text(json.dumps(settings))
    again, sources = vision_processor.resolve_media_kwargs({}, tmp_path)
    assert again == media_kwargs and media_kwargs["video_pixels_per"] == "clip"
    assert "smoke default" not in sources.values()
    vision_processor.check_processor_geometry(model_cfg.vision, tmp_path)


def test_export_refuses_our_own_vision_tower_by_name():
    from valen_jax import export
    from valen_jax.models.config import ModelConfig, VisionConfig

    tower = VisionConfig(patch_size=8, merge_size=2, temporal_patch_size=2, dim=32, num_layers=1, num_heads=4,
                         mlp_dim=64)
    with pytest.raises(export.ExportError, match="family 'valen'.*no Hugging Face class holds it"):
        export.exportable(ModelConfig(vocab_size=128, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                                      mlp_dim=128, vision=tower))
    export.exportable(ModelConfig(vocab_size=128, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                                  mlp_dim=128))  # a text-only model exports


@pytest.mark.slow
@pytest.mark.parametrize("scan", [False, True])
def test_what_a_checkpoint_lacks_starts_as_init_params_would_start_it(scan):
    """initial_params initialises only the score head (and a text checkpoint's tower), not a whole
    model the checkpoint then replaces; the values are those of the full initialisation."""
    from valen_jax.models.config import ModelConfig, VisionConfig
    from valen_jax.models.transformer import init_params

    cfg = ModelConfig(vocab_size=256, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128,
                      scan_layers=scan, score_head=True, vision=VisionConfig(8, 2, 2, 32, 1, 4, 64))
    shardings = _shardings(cfg)
    full = _host(init_params(cfg, 3, shardings))
    part = _host(build.fresh_subtrees(cfg, 3, shardings, ("vision", "score_head")))
    assert sorted(part) == ["score_head", "vision"]
    jax.tree.map(np.testing.assert_array_equal, part, {name: full[name] for name in part})


def test_an_hf_variant_run_without_its_checkpoint_is_refused_by_name():
    config = _config("unused")
    config.model.init_from = None
    with pytest.raises(ConfigError, match=r"config.model.\{dim, .*tie_embeddings\} are unset and "
                                          "config.model.init_from is not given"):
        build.model_config(config, load_tokenizer(ROOT / "data/tokenizer", "chatml"))


def _hub_form(nested: dict) -> dict:
    """config.json as the hub checkpoints ship it (transformers 4.x wrote it). Qwen2-VL / Qwen2.5-VL: flat,
    decoder keys at the top, M-RoPE as rope_scaling {"type": "mrope"}, the tower's in_chans. Qwen3-VL:
    nested, with text_config.rope_scaling and rope_theta instead of rope_parameters."""
    text = dict(nested["text_config"])
    rope = dict(text.pop("rope_parameters"))
    if nested["model_type"] == "qwen3_vl":
        text.update(rope_theta=rope.pop("rope_theta"), rope_scaling=rope)
        return {**nested, "text_config": text}
    text.pop("model_type")
    vision = {("in_chans" if key == "in_channels" else key): value for key, value in nested["vision_config"].items()}
    top = {key: value for key, value in nested.items() if key not in ("text_config", "vision_config")}
    return {**top, **text, "vision_config": vision, "rope_theta": rope["rope_theta"],
            "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_config_form_hub_checkpoints_ship_gives_the_same_model(vl_checkpoint, family, tmp_path):
    import shutil

    directory, _ = vl_checkpoint(family)
    hub_dir = shutil.copytree(directory, tmp_path / "hub")
    hub_form = _hub_form(json.loads((directory / "config.json").read_text()))
    assert "rope_parameters" not in hub_form.get("text_config", hub_form)
    (hub_dir / "config.json").write_text(json.dumps(hub_form))
    tokenizer = load_tokenizer(directory, "chatml")
    assert build.model_config(_config(hub_dir), tokenizer) == build.model_config(_config(directory), tokenizer)

"""Logits parity with transformers (torch, CPU, f32) for tiny random Qwen2-VL, Qwen2.5-VL and Qwen3-VL models:
text, two images of different sizes and a two-frame video in one prompt; import, then export → transformers load."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.train_runs import ROOT, env_with_devices  # noqa: E402
from valen_jax.models import hf, hf_vl, mrope  # noqa: E402
from valen_jax.models.transformer import abstract_model  # noqa: E402

VOCAB, IMAGE, VIDEO, START, END = 320, 310, 311, 312, 313
MERGE = 2
# (t, h, w) in patches: two images of different aspect ratios, then a two-frame clip. With Qwen2.5-VL's
# window of 16 pixels (2 × 2 merged cells) the 16 × 10 image has partial windows at its edge.
IMAGE_GRIDS = [(1, 8, 12), (1, 16, 10)]
VIDEO_GRIDS = [(2, 8, 8)]
SECONDS_PER_GRID = 1.25  # Qwen2.5-VL: with tokens_per_second 2, frames at time positions 0 and 2
VISION = dict(num_heads=2, patch_size=4, spatial_merge_size=MERGE, temporal_patch_size=2, initializer_range=0.1)
FAMILIES = {
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration",
                 dict(depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2)),
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration",
                   dict(depth=3, hidden_size=32, intermediate_size=48, out_hidden_size=64, window_size=16,
                        fullatt_block_indexes=[1], tokens_per_second=2)),
    # A 6 × 6 position table resampled to every grid; deepstack features from vision blocks 0 and 2.
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration",
                 dict(depth=3, hidden_size=32, intermediate_size=48, out_hidden_size=64, num_position_embeddings=36,
                      deepstack_visual_indexes=[0, 2])),
}
TEXT = {"qwen3_vl": dict(head_dim=16, attention_bias=False)}
ROPE = {"qwen3_vl": dict(mrope_interleaved=True)}


def _config(family):
    config_cls, _, vision = FAMILIES[family]
    return getattr(transformers, config_cls)(
        text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, initializer_range=0.1,
                         bos_token_id=300, eos_token_id=301, **TEXT.get(family, {}),
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                          **ROPE.get(family, {})}),
        vision_config={**VISION, **vision},
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
        attn_implementation="eager")


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def reference(request, tmp_path_factory):
    """(HF model, its saved directory): norms and biases moved off their initial one/zero."""
    torch.manual_seed(0)
    model_cls = getattr(transformers, FAMILIES[request.param][1])
    model = model_cls(_config(request.param)).float().eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.ndim == 1:
                base = 1.0 if ("norm" in name or "ln_q" in name) and name.endswith("weight") else 0.0
                parameter.copy_(base + 0.3 * torch.randn_like(parameter))
    directory = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(directory)
    return model, directory


def _slot_runs(family):
    """(pad token, grid) of each run of media slots in prompt order: image, video, image. Qwen3-VL's
    processor gives every video frame its own run after a timestamp, and its rope index follows that."""
    t, h, w = VIDEO_GRIDS[0]
    video = [(VIDEO, (1, h, w))] * t if family == "qwen3_vl" else [(VIDEO, VIDEO_GRIDS[0])]
    return [(IMAGE, IMAGE_GRIDS[0]), *video, (IMAGE, IMAGE_GRIDS[1])]


def _prompt(family):
    """Token ids (≥ 600) with text around <|vision_start|> slots <|vision_end|> for image, video, image."""
    rng = np.random.default_rng(1)
    ids = []
    texts = [180, 150, 4, 120] if family == "qwen3_vl" else [180, 150, 120]  # 4: a frame's timestamp
    for (pad, (t, h, w)), before in zip(_slot_runs(family), texts, strict=True):
        ids += list(rng.integers(0, 300, before)) + [START] + [pad] * (t * h * w // MERGE**2) + [END]
    ids += list(rng.integers(0, 300, 100))
    return np.asarray(ids, np.int64)


def _pixels(grids, seed):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(t * h * w, 3 * 2 * 4 * 4)).astype(np.float32) for t, h, w in grids]


def _is_2_5(model_or_cfg):
    return getattr(model_or_cfg, "config", model_or_cfg).model_type == "qwen2_5_vl"


def _hf_logits(model, ids, images, videos):
    kind = np.where(ids == IMAGE, 1, np.where(ids == VIDEO, 2, 0))
    extra = {"second_per_grid_ts": torch.tensor([SECONDS_PER_GRID])} if _is_2_5(model) else {}
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids[None]), mm_token_type_ids=torch.tensor(kind[None]),
                    pixel_values=torch.tensor(np.concatenate(images)), image_grid_thw=torch.tensor(IMAGE_GRIDS),
                    pixel_values_videos=torch.tensor(np.concatenate(videos)),
                    video_grid_thw=torch.tensor(VIDEO_GRIDS), **extra)
    return out.logits[0].numpy()


def _time_intervals(cfg):
    """Per slot run in prompt order (image, video, image): Qwen2.5-VL spaces video frames in time."""
    if cfg.vision.family != "qwen2_5_vl":
        return None
    return [1.0, cfg.vision.tokens_per_second * SECONDS_PER_GRID, 1.0]


def _family(reference):
    return reference[0].config.model_type


def _our_logits(model, ids, images, videos):
    # Media in the order their slots appear in the prompt: image 0, the video, image 1.
    grids = [grid for _, grid in _slot_runs(model.cfg.vision.family)]
    patches = np.concatenate([images[0], videos[0], images[1]])
    patch_positions, segments = mrope.vision_inputs(grids, MERGE)
    positions = mrope.rope_index(ids, grids, IMAGE, VIDEO, MERGE, _time_intervals(model.cfg))
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda s, *a: nnx.merge(graphdef, s)(*a))
    tokens = jnp.asarray(ids[None], jnp.int32)
    vision = (jnp.asarray(patches[None]), jnp.asarray(patch_positions[None]), jnp.asarray(segments[None]))
    return np.asarray(forward(state, tokens, jnp.asarray(positions[None]), jnp.ones_like(tokens), vision))[0]


# Qwen2-VL in the fast tier; the other two families (a forward compile each) with the slow tests.
@pytest.mark.parametrize("reference", [pytest.param("qwen2_5_vl", marks=pytest.mark.slow), "qwen2_vl",
                                       pytest.param("qwen3_vl", marks=pytest.mark.slow)], indirect=True)
def test_import_and_export_match_transformers_logits(reference, tmp_path):
    hf_model, directory = reference
    ids = _prompt(_family(reference))
    assert len(ids) >= 600
    images, videos = _pixels(IMAGE_GRIDS, 2), _pixels(VIDEO_GRIDS, 3)
    expected = _hf_logits(hf_model, ids, images, videos)

    model, cfg = hf.from_pretrained(directory)
    assert cfg.vision.family == hf_model.config.model_type and cfg.mrope_section == (2, 3, 3)
    ours = _our_logits(model, ids, images, videos)
    assert ours.shape == expected.shape
    np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=0)
    if cfg.vision.window_size:  # the windows matter: the same weights without them are far off
        unwindowed = dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision, window_size=0))
        plain = nnx.merge(abstract_model(unwindowed)[0], nnx.state(model))
        assert np.abs(_our_logits(plain, ids, images, videos) - expected).max() > 1e-2

    hf.save_pretrained(model, tmp_path / "export")
    reloaded = type(hf_model).from_pretrained(tmp_path / "export", attn_implementation="eager").float().eval()
    np.testing.assert_allclose(_hf_logits(reloaded, ids, images, videos), expected, atol=1e-4, rtol=0)


def test_config_survives_checkpoint_meta_json(reference):
    """Checkpoint meta stores ModelConfig as JSON: tuples come back as tuples, so configs compare equal."""
    from valen_jax.models.config import ModelConfig

    cfg = hf_vl.config_from_hf(json.loads((reference[1] / "config.json").read_text()))
    assert ModelConfig.from_json(json.loads(json.dumps(cfg.to_json()))) == cfg


def test_the_text_importer_refuses_a_vision_language_checkpoint(reference):
    with pytest.raises(hf.HFImportError, match="vision-language checkpoint"):
        hf.config_from_hf(json.loads((reference[1] / "config.json").read_text()))


def test_media_with_one_dimensional_positions_is_refused(reference):
    model, _ = hf.from_pretrained(reference[1])
    ids = _prompt(_family(reference))
    patches = np.concatenate([*_pixels(IMAGE_GRIDS, 2), *_pixels(VIDEO_GRIDS, 3)])[None]
    positions, segments = mrope.vision_inputs([grid for _, grid in _slot_runs(_family(reference))], MERGE)
    tokens = jnp.asarray(ids[None], jnp.int32)
    with pytest.raises(ValueError, match=r"positions \[B, T, 3\]"):
        jax.eval_shape(lambda: model(tokens, jnp.arange(len(ids))[None], jnp.ones_like(tokens),
                                     (jnp.asarray(patches), jnp.asarray(positions[None]), jnp.asarray(segments[None]))))


def test_rope_index_matches_transformers(reference):
    hf_model, directory = reference
    ids = _prompt(_family(reference))
    kind = np.where(ids == IMAGE, 1, np.where(ids == VIDEO, 2, 0))
    extra = {"second_per_grid_ts": torch.tensor([SECONDS_PER_GRID])} if _is_2_5(hf_model) else {}
    expected, _ = hf_model.model.get_rope_index(torch.tensor(ids[None]), torch.tensor(kind[None]),
                                                torch.tensor(IMAGE_GRIDS), torch.tensor(VIDEO_GRIDS), **extra)
    cfg = hf_vl.config_from_hf(json.loads((directory / "config.json").read_text()))
    ours = mrope.rope_index(ids, [grid for _, grid in _slot_runs(_family(reference))], IMAGE, VIDEO, MERGE,
                            _time_intervals(cfg))
    np.testing.assert_array_equal(ours, expected[:, 0].numpy().T)


@pytest.mark.parametrize("change, feature", [
    (lambda c: c.update(model_type="qwen3_vl_moe"), "mixture-of-experts"),
    (lambda c: c["text_config"].update(use_sliding_window=True), "sliding-window"),
    (lambda c: c["text_config"]["rope_parameters"].update(rope_type="yarn"), "rope_type 'yarn'"),
    (lambda c: c["vision_config"].update(hidden_act="relu"), "hidden_act 'relu'"),
])
def test_unsupported_vl_features_are_refused_by_name(reference, change, feature):
    config = json.loads((reference[1] / "config.json").read_text())
    change(config)
    with pytest.raises((hf.HFImportError, ValueError), match=feature):
        hf_vl.config_from_hf(config)


SHARDED = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from valen_jax.models import sharding
from valen_jax.models import hf
from tests.test_hf_vl_parity import _our_logits, _pixels, _prompt, IMAGE_GRIDS, VIDEO_GRIDS

mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
model, cfg = hf.from_pretrained(sys.argv[1], mesh=mesh)
vision = nnx.to_pure_dict(nnx.state(model, nnx.Param))["vision"]
replicated = ["/".join(map(str, (k.key for k in path))) for path, leaf in jax.tree_util.tree_leaves_with_path(vision)
              if leaf.size >= 1024 and all(s is None for s in leaf.sharding.spec)]
ids, images, videos = _prompt(cfg.vision.family), _pixels(IMAGE_GRIDS, 2), _pixels(VIDEO_GRIDS, 3)
with jax.set_mesh(mesh):
    sharded = _our_logits(model, ids, images, videos)
local, _ = hf.from_pretrained(sys.argv[1])
print(json.dumps({"replicated": replicated, "devices": len(vision["merge_in"].sharding.device_set),
                  "max_diff": float(np.abs(sharded - _our_logits(local, ids, images, videos)).max())}))
"""


# Qwen3-VL's tower holds every kind of vision parameter the others have (Qwen2.5-VL's gate/up carry
# fc1's logical axes) plus its own; one 8-device run (~25 s here) covers them all.
@pytest.mark.parametrize("reference", ["qwen3_vl"], indirect=True)
@pytest.mark.slow
def test_vision_tower_is_sharded_on_8_devices_with_unchanged_logits(reference):
    """Every vision parameter of 1024+ elements is split by the logical rules; logits equal one device's."""
    result = subprocess.run([sys.executable, "-c", SHARDED, str(reference[1])], cwd=ROOT, env=env_with_devices(8),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["replicated"] == []
    assert report["devices"] == 8
    assert report["max_diff"] < 1e-4


@pytest.mark.parametrize("reference", ["qwen3_vl"], indirect=True)  # deepstack is Qwen3-VL's
def test_deepstack_with_scanned_layers_is_refused(reference):
    with pytest.raises(hf.HFImportError, match="deepstack"):
        hf.from_pretrained(reference[1], scan_layers=True)

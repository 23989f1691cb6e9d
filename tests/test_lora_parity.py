"""A LoRA model against transformers (f32, CPU): its merged export, and PEFT loading our adapter folder onto
the base, give our logits (≤ 1e-4), per text family; the adapters perturbed so they are far from zero."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tests.test_hf_parity import COMMON, _our_logits, _random_hf_model, _torch_logits  # noqa: E402
from valen_jax.models import hf, lora, peft_adapter  # noqa: E402
from valen_jax.training.optim import path_of  # noqa: E402

# The rank 8 of every linear layer, alpha 16: the update (alpha/r)·A·B is of the order of the weights.
ADAPTERS = lora.LoraConfig(rank=8, alpha=16.0)


def _perturbed(model):
    """B random (fresh adapters have B = 0, and a zero adapter would pass any mapping)."""
    graphdef, state = nnx.split(model)
    keys = iter(jax.random.split(jax.random.key(3), 256))
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: 0.05 * jax.random.normal(next(keys), x.shape, x.dtype) if path_of(p).endswith(lora.SUFFIX_B)
        else x, nnx.to_pure_dict(state))
    return nnx.merge(graphdef, params)


@pytest.mark.parametrize("family,scan_layers", [("qwen2", False), ("qwen3", True), ("llama", False)])
def test_merged_export_and_the_peft_adapter_give_our_logits(family, scan_layers, tmp_path):
    base = _random_hf_model(family, tmp_path / "hf")
    model, cfg = hf.from_pretrained(tmp_path / "hf", scan_layers=scan_layers, lora=ADAPTERS)
    ids = np.random.default_rng(4).integers(0, COMMON["vocab_size"], (1, 300))
    base_logits = _torch_logits(base, ids)
    np.testing.assert_allclose(_our_logits(model, ids), base_logits, atol=1e-4)  # B = 0: the base itself
    model = _perturbed(model)
    ours = _our_logits(model, ids)
    assert np.abs(ours - base_logits).max() > 1e-2  # the adapters change the function

    hf.save_pretrained(model, tmp_path / "merged", family=family)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="eager",
                                                               dtype=torch.float32).eval()
    assert np.abs(_torch_logits(merged, ids) - ours).max() <= 1e-4

    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))
    peft_adapter.save_adapter(cfg, params, tmp_path / "adapter", base=str(tmp_path / "hf"))
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    # Every targeted linear layer is wrapped, and every tensor we wrote was loaded (none left at init).
    assert len([m for m in adapted.modules() if isinstance(m, peft.tuners.lora.Linear)]) == 7 * cfg.num_layers
    assert np.abs(_torch_logits(adapted, ids) - ours).max() <= 1e-4


def _qwen2_5_vl_base(folder):
    """A tiny random Qwen2.5-VL with its norms and biases perturbed (so no vector sits at its identity init),
    saved to `folder`, and a prompt of two images and a video: (model, ids, images, videos)."""
    from tests.test_hf_vl_parity import IMAGE_GRIDS, VIDEO_GRIDS, _config, _pixels, _prompt

    torch.manual_seed(0)
    hf_model = transformers.Qwen2_5_VLForConditionalGeneration(_config("qwen2_5_vl")).float().eval()
    with torch.no_grad():
        for name, parameter in hf_model.named_parameters():
            if parameter.ndim == 1:
                base = 1.0 if ("norm" in name or "ln_q" in name) and name.endswith("weight") else 0.0
                parameter.copy_(base + 0.3 * torch.randn_like(parameter))
    hf_model.save_pretrained(folder)
    return hf_model, _prompt("qwen2_5_vl"), _pixels(IMAGE_GRIDS, 2), _pixels(VIDEO_GRIDS, 3)


@pytest.mark.heavy  # a VL forward compiled twice, two transformers loads
def test_a_qwen2_5_vl_lora_model_equals_its_merged_export_and_its_peft_adapter(tmp_path):
    """Qwen2.5-VL with adapters on its decoder (images and a video through the frozen tower): our logits
    equal the merged export in transformers and PeftModel over the base (PEFT's names under
    `model.language_model`)."""
    from tests.test_hf_vl_parity import _hf_logits, _our_logits

    hf_model, ids, images, videos = _qwen2_5_vl_base(tmp_path / "hf")
    base_logits = _hf_logits(hf_model, ids, images, videos)

    model, cfg = hf.from_pretrained(tmp_path / "hf", lora=ADAPTERS)
    model = _perturbed(model)
    ours = _our_logits(model, ids, images, videos)
    assert np.abs(ours - base_logits).max() > 1e-2  # the adapters change the function

    _, adapted = _merged_export_checked_then_peft(model, cfg, hf_model, tmp_path, (ids, images, videos), ours)
    # Only the decoder's linear layers are wrapped (the tower keeps its own qkv/proj untouched).
    assert len([m for m in adapted.modules() if isinstance(m, peft.tuners.lora.Linear)]) == 7 * cfg.num_layers
    assert np.abs(_hf_logits(adapted, ids, images, videos) - ours).max() <= 1e-4


def _merged_export_checked_then_peft(model, cfg, hf_model, tmp_path, inputs, ours):
    """Asserts the merged export (`hf.save_pretrained`, read by transformers) gives `ours` within 1e-4, then
    writes the PEFT adapter folder and returns (our params as NumPy, PeftModel over `hf_model` with it)."""
    from tests.test_hf_vl_parity import _hf_logits

    hf.save_pretrained(model, tmp_path / "merged")
    merged = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        tmp_path / "merged", attn_implementation="eager").float().eval()
    assert np.abs(_hf_logits(merged, *inputs) - ours).max() <= 1e-4
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))
    peft_adapter.save_adapter(cfg, params, tmp_path / "adapter", base=str(tmp_path / "hf"))
    return params, peft.PeftModel.from_pretrained(hf_model, tmp_path / "adapter").eval()


# Every decoder linear layer, and in Qwen2.5-VL's tower every block's qkv, proj and MLP and the merger's two.
TOWER = ("vision/qkv", "vision/proj", "vision/gate", "vision/up", "vision/down", "vision/merge_in",
         "vision/merge_out")


@pytest.mark.heavy  # a VL forward compiled twice, two transformers loads
def test_qwen2_5_vl_with_tower_and_merger_adapters_equals_its_merged_export_and_its_peft_adapter(tmp_path):
    """Adapters on the vision tower and patch merger as well as the decoder (an image prompt: two images and
    a video): our logits equal the merged export in transformers and PeftModel over the base, whose
    `target_modules` regex wraps exactly the modules we adapted; the folder reads back (init_adapter) to
    the same adapters."""
    from tests.test_hf_vl_parity import _hf_logits, _our_logits
    from valen_jax.models import lora_init

    hf_model, ids, images, videos = _qwen2_5_vl_base(tmp_path / "hf")

    adapters = lora.LoraConfig(rank=8, alpha=16.0, targets=lora.ATTENTION + lora.MLP + TOWER)
    model, cfg = hf.from_pretrained(tmp_path / "hf", lora=adapters)
    tower_adapters = [p for p in lora.adapter_tree(nnx.to_pure_dict(nnx.state(model))).get("vision", {})]
    assert tower_adapters  # the tower and merger hold adapters, not only the decoder
    # Only the tower's adapters perturbed first: the tower's mapping alone must move the logits.
    graphdef, state = nnx.split(model)
    keys = iter(jax.random.split(jax.random.key(9), 256))
    tower_only = jax.tree_util.tree_map_with_path(
        lambda p, x: 0.05 * jax.random.normal(next(keys), x.shape, x.dtype)
        if path_of(p).startswith("vision/") and path_of(p).endswith(lora.SUFFIX_B) else x, nnx.to_pure_dict(state))
    base_logits = _hf_logits(hf_model, ids, images, videos)
    assert np.abs(_our_logits(nnx.merge(graphdef, tower_only), ids, images, videos) - base_logits).max() > 1e-2
    model = _perturbed(model)
    ours = _our_logits(model, ids, images, videos)

    params, adapted = _merged_export_checked_then_peft(model, cfg, hf_model, tmp_path, (ids, images, videos), ours)
    wrapped = {name.removeprefix("base_model.model.") for name, m in adapted.named_modules()
               if isinstance(m, peft.tuners.lora.Linear)}
    blocks = cfg.vision.num_layers
    assert len(wrapped) == 7 * cfg.num_layers + 5 * blocks + 2
    assert {f"model.visual.blocks.{i}.{m}" for i in range(blocks) for m in
            ("attn.qkv", "attn.proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")} | \
        {"model.visual.merger.mlp.0", "model.visual.merger.mlp.2"} <= wrapped
    assert np.abs(_hf_logits(adapted, ids, images, videos) - ours).max() <= 1e-4

    # init_adapter: the folder read back is our adapters, tower included, bit for bit (f32 both ways).
    read = peft_adapter.load_adapter(cfg, tmp_path / "adapter", lora_init.adapter_shapes(cfg))
    ours_adapters = lora.adapter_tree(params)
    assert jax.tree.structure(read) == jax.tree.structure(ours_adapters)
    for got, want in zip(jax.tree.leaves(read), jax.tree.leaves(ours_adapters), strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("scan_layers", [False, pytest.param(True, marks=pytest.mark.heavy)])
def test_an_adapter_peft_trained_is_read_back_with_peft_logits_and_a_mismatch_is_refused(scan_layers, tmp_path):
    """`peft_adapter.load_adapter` (config.model.lora.init_adapter): an adapter PEFT itself made and saved
    (get_peft_model, B randomised) read into our model gives PeftModel's logits; another rank, a tensor
    missing, or one we do not adapt is refused naming the file and key."""
    import json as json_lib
    import shutil

    from valen_jax.models import lora_init
    from valen_jax.models.safetensors_io import SafetensorsFile, save_file

    base = _random_hf_model("qwen2", tmp_path / "hf")
    peft_model = peft.get_peft_model(base, peft.LoraConfig(
        r=ADAPTERS.rank, lora_alpha=ADAPTERS.alpha, lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    torch.manual_seed(5)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(0.05 * torch.randn_like(parameter))
    peft_model.save_pretrained(tmp_path / "adapter")
    ids = np.random.default_rng(4).integers(0, COMMON["vocab_size"], (1, 200))
    expected = _torch_logits(peft_model.eval(), ids)

    model, cfg = hf.from_pretrained(tmp_path / "hf", scan_layers=scan_layers, lora=ADAPTERS)
    adapters = peft_adapter.load_adapter(cfg, tmp_path / "adapter", lora_init.adapter_shapes(cfg))
    graphdef, state = nnx.split(model)
    params = lora.with_adapters(nnx.to_pure_dict(state), jax.tree.map(jnp.asarray, adapters))
    ours = _our_logits(nnx.merge(graphdef, params), ids)
    assert np.abs(ours - expected).max() <= 1e-4
    assert np.abs(ours - _our_logits(model, ids)).max() > 1e-2  # the adapters were read, not left fresh

    def refused(edit, match):
        broken = tmp_path / f"broken-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(tmp_path / "adapter", broken)
        edit(broken)
        with pytest.raises(hf.HFImportError, match=match):
            peft_adapter.load_adapter(cfg, broken, lora_init.adapter_shapes(cfg))

    def rank(folder):
        saved = json_lib.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json_lib.dumps({**saved, "r": 4}))

    def tensors(folder, keep, extra=False):
        stored = SafetensorsFile(folder / "adapter_model.safetensors")
        kept = {k: np.array(stored.get(k)) for k in stored.keys() if keep(k)}  # copies: the file is rewritten
        if extra:
            kept["base_model.model.lm_head.lora_A.weight"] = np.zeros((8, 64), np.float32)
        save_file(kept, folder / "adapter_model.safetensors")

    refused(rank, r"adapter_config.json: r=4, where config.model.lora asks 8")
    refused(lambda f: tensors(f, lambda k: "layers.1.mlp.down_proj.lora_B" not in k),
            r"adapter_model.safetensors: no tensor 'base_model.model.model.layers.1.mlp.down_proj.lora_B.weight'")
    refused(lambda f: tensors(f, lambda k: True, extra=True), r"'base_model.model.lm_head.lora_A.weight' is an adapter")
    with pytest.raises(hf.HFImportError, match=r"no adapter_config.json"):
        peft_adapter.load_adapter(cfg, tmp_path, lora_init.adapter_shapes(cfg))

"""What an export writes back of its source checkpoint (`valen_jax/models/hf_source.py`), on files alone: a hub
config in transformers 4's form keeps every field the run did not change and reads back in transformers with
the same rope and ids; the training tokenizer keeps the template it replaced without its fingerprint moving
(shards converted before still load); an exported tokenizer's default template is the checkpoint's own."""

from __future__ import annotations

import dataclasses
import json

import pytest

transformers = pytest.importorskip("transformers")

from data_pipeline import tokenizer as tokenizers  # noqa: E402
from data_pipeline.chat_templates import TRAINING_TEMPLATES  # noqa: E402
from tests.test_export_roundtrip import HUB_TEMPLATE  # noqa: E402
from valen_jax.models import hf_source, hf_text  # noqa: E402

# Qwen2.5-0.5B-Instruct's config.json as the hub serves it (transformers 4's names), shrunk.
HUB_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
    "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 128,
    "max_position_embeddings": 32768, "max_window_layers": 21, "model_type": "qwen2", "num_attention_heads": 4,
    "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}


@pytest.mark.parametrize("param_dtype", ["bfloat16", "float32"])
def test_a_hub_config_keeps_every_field_the_run_did_not_change(param_dtype, tmp_path):
    cfg = hf_text.config_from_hf(HUB_CONFIG, param_dtype=param_dtype)
    cfg = dataclasses.replace(cfg, vocab_size=152704)  # 1,026 tokens added past the tokenizer's 151,665
    ours = hf_text.config_to_hf(cfg, "qwen2")
    config = hf_source.exported_config(ours, HUB_CONFIG, {"eos_token_id": 151645, "pad_token_id": 151643})
    changed = {key for key in HUB_CONFIG if config[key] != HUB_CONFIG[key]}
    assert changed == {"vocab_size"} | ({"torch_dtype"} if param_dtype == "float32" else set()), changed
    # The source's bos (which the tokenizer lacks) and max_position_embeddings stay; the pad id it left out
    # is the tokenizer's.
    assert (config["bos_token_id"], config["max_position_embeddings"], config["pad_token_id"]) == (151643, 32768,
                                                                                                 151643)
    (tmp_path / "config.json").write_text(json.dumps(config))
    read = transformers.AutoConfig.from_pretrained(tmp_path)
    assert read.rope_parameters["rope_theta"] == 1000000.0 and read.rope_parameters["rope_type"] == "default"
    assert read.max_position_embeddings == 32768 and read.vocab_size == 152704
    # Without a source (a model trained from scratch): ours, with the tokenizer's ids.
    assert hf_source.exported_config(ours, None, {"eos_token_id": 7}) == {**ours, "eos_token_id": 7}
    assert hf_source.exported_generation_config(config, None) == {
        "_from_model_config": True, "bos_token_id": 151643, "eos_token_id": 151645, "pad_token_id": 151643}


def _hub_tokenizer(directory):
    from tests.test_export_roundtrip import _hub_like_qwen2

    pytest.importorskip("torch")
    _hub_like_qwen2(directory)
    return directory


@pytest.mark.slow
def test_the_training_tokenizer_keeps_the_replaced_template_and_its_fingerprint(tmp_path):
    base = _hub_tokenizer(tmp_path / "base")
    loaded = tokenizers.load_tokenizer(base, "chatml")
    assert loaded.chat_template == TRAINING_TEMPLATES["chatml"]
    assert tokenizers.checkpoint_chat_template(loaded) == HUB_TEMPLATE
    # The fingerprint is the training template's, as before: shards converted before still load.
    assert tokenizers.fingerprint(loaded).chat_template_sha256 == tokenizers.sha256_text(TRAINING_TEMPLATES["chatml"])
    # A template with markers is trained as it is: nothing was replaced.
    loaded.save_pretrained(tmp_path / "trained")
    assert tokenizers.checkpoint_chat_template(tokenizers.load_tokenizer(tmp_path / "trained", "chatml")) is None

    hf_source.keep(tmp_path / "source", str(base), tokenizers.checkpoint_chat_template(loaded))
    assert hf_source.read_template_files(tmp_path / "source") == HUB_TEMPLATE
    assert sorted(p.name for p in (tmp_path / "source").iterdir()) == ["chat_template.jinja", "config.json",
                                                                        "generation_config.json"]
    hf_source.write_templates(tmp_path / "trained", loaded.chat_template, HUB_TEMPLATE)
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "trained")
    assert exported.chat_template == {"default": HUB_TEMPLATE, "training": TRAINING_TEMPLATES["chatml"]}
    chat = [{"role": "user", "content": "2+2="}]
    assert "You are a helpful assistant." in exported.apply_chat_template(chat, tokenize=False)
    assert "You are a helpful" not in exported.apply_chat_template(chat, tokenize=False, chat_template="training")


# Qwen2.5-VL-3B-Instruct's config.json as the hub serves it (the flat form of transformers 4.49), shrunk.
HUB_VL_CONFIG = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "vision_token_id": 151654, "image_token_id": 151655, "video_token_id": 151656, "hidden_act": "silu",
    "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 96, "max_position_embeddings": 128000,
    "max_window_layers": 70, "model_type": "qwen2_5_vl", "num_attention_heads": 4, "num_hidden_layers": 2,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.49.0", "use_cache": True,
    "use_sliding_window": False, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
    "vision_config": {"depth": 2, "hidden_act": "silu", "hidden_size": 32, "intermediate_size": 48, "num_heads": 2,
                      "in_chans": 3, "out_hidden_size": 64, "patch_size": 8, "spatial_merge_size": 2,
                      "spatial_patch_size": 8, "window_size": 32, "fullatt_block_indexes": [1],
                      "tokens_per_second": 2, "temporal_patch_size": 2},
    "vocab_size": 151936}


def test_a_flat_hub_vl_config_keeps_its_fields_and_states_the_grown_vocabulary(tmp_path):
    from valen_jax.models import hf_vl

    cfg = hf_vl.config_from_hf(HUB_VL_CONFIG, param_dtype="bfloat16")
    ours = hf_vl.config_to_hf(dataclasses.replace(cfg, vocab_size=152704))
    config = hf_source.exported_config(ours, HUB_VL_CONFIG, {"eos_token_id": 151645, "vision_start_token_id": 151652,
                                                             "vision_end_token_id": 151653})
    changed = {key for key in HUB_VL_CONFIG if config[key] != HUB_VL_CONFIG[key]}
    assert changed == {"vocab_size", "vision_config"}, changed
    vision = HUB_VL_CONFIG["vision_config"]  # ours adds keys there (in_channels...), and changes none
    assert {key for key in vision if config["vision_config"][key] != vision[key]} == set()
    (tmp_path / "config.json").write_text(json.dumps(config))
    read = transformers.AutoConfig.from_pretrained(tmp_path)
    assert (read.text_config.vocab_size, read.text_config.max_position_embeddings) == (152704, 128000)
    assert read.text_config.rope_parameters["mrope_section"] == [2, 3, 3] and read.bos_token_id == 151643
    assert hf_vl.config_from_hf(config, param_dtype="bfloat16") == dataclasses.replace(cfg, vocab_size=152704)

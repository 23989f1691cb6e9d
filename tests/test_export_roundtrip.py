"""`python -m valen_jax.export` of a LoRA run from a tiny random Qwen2 checkpoint saved as hub checkpoints are
(a chat template without `{% generation %}` markers, `bos_token_id`, `max_position_embeddings` 1024, a
generation_config.json of its own), merged and `--adapter`: what a user's serving stack reads round-trips.

Merged: config.json keeps every field of the source's that the run did not change (vocab_size grows by the
added tokens), generation_config.json is the source's, the tokenizer's default chat template is the
checkpoint's own with the training template beside it as "training", and transformers loads it. Adapter: the
base, resized as transformers resizes it, plus PeftModel gives the merged export's logits (≤ 1e-4, f32).
The workdir keeps the source's files at start-up (WORKDIR/source): the export writes back those, not the
source's files as they are by then.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from tests.export_loading import merged_and_adapter_logits
from tests.train_runs import ROOT, run_module, run_train

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytestmark = pytest.mark.heavy

# A Qwen-style inference template: no generation markers, a default system turn (what hub checkpoints ship).
HUB_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' -%}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}"
    "{%- endif -%}{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
GENERATION = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "repetition_penalty": 1.05}


def _hub_like_qwen2(directory):
    """A tiny random Qwen2 with a BPE tokenizer trained on the task's rows, saved as a hub checkpoint is."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [line for line in (ROOT / "data/rl_arith/digits/train.jsonl").read_text().splitlines()]
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = HUB_TEMPLATE
    tokenizer.save_pretrained(directory)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in ("<|endoftext|>", "<|im_end|>")}
    config = transformers.Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      tie_word_embeddings=True, max_position_embeddings=1024,
                                      bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                                      initializer_range=0.1)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=ids["<|endoftext|>"], eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"], **GENERATION)
    model.save_pretrained(directory)
    return json.loads((directory / "config.json").read_text()), \
        json.loads((directory / "generation_config.json").read_text())


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(source config, source generation config, base folder, merged export, adapter export, workdir)."""
    root = tmp_path_factory.mktemp("roundtrip")
    base = root / "base"
    config, generation = _hub_like_qwen2(base)
    shards = {}
    for split in ("train", "eval"):  # converted first: a hub template needs --template-family (issue 54, 1)
        shards[split] = root / f"{split}-shards"
        run_module("data_pipeline.convert", "--format=chat", f"--input={ROOT / f'data/rl_arith/digits/{split}.jsonl'}",
                   f"--output={shards[split]}", f"--tokenizer={base}", "--template-family=chatml")
    workdir = root / "run"
    run_train("configs/reinforce.py:sft,hf,lora", workdir, f"--config.model.init_from={base}",
              f"--config.data.tokenizer={base}", f"--config.data.train={shards['train']}",
              f"--config.data.eval={shards['eval']}", "--config.train.steps=3", "--config.train.checkpoint_every=3",
              "--config.train.log_every=1", "--config.train.warmup_steps=1", "--config.train.learning_rate=2e-2",
              "--config.model.dtype=float32", "--config.eval.at_end=False", "--config.eval.every=0",
              "--config.data.global_batch=8", "--config.model.lora.rank=4")
    # The source changed after training (a LoRA run's export needs its base, so it cannot be gone): the
    # workdir's copy, kept at start-up, is what the export writes back.
    (base / "generation_config.json").write_text(json.dumps({**generation, "temperature": 1.5}))
    merged, adapter = root / "merged", root / "adapter"
    run_module("valen_jax.export", f"--workdir={workdir}", f"--output={merged}")
    run_module("valen_jax.export", f"--workdir={workdir}", f"--output={adapter}", "--adapter")
    return config, generation, base, merged, adapter, workdir


def test_the_merged_export_keeps_the_sources_config_generation_config_and_chat_template(exported):
    from data_pipeline.chat_templates import TRAINING_TEMPLATES

    source, generation, base, merged, _, workdir = exported
    config = json.loads((merged / "config.json").read_text())
    tokenizer = transformers.AutoTokenizer.from_pretrained(merged)
    # Every field of the source's is kept, but the vocabulary the added tokens grew, and the pad id the source
    # left null, which the tokenizer states.
    changed = {key for key in source if config.get(key) != source[key]}
    assert changed == {"vocab_size", "pad_token_id"}, {key: (source[key], config.get(key)) for key in changed}
    assert source["pad_token_id"] is None and config["pad_token_id"] == tokenizer.pad_token_id
    assert config["vocab_size"] >= len(tokenizer) > source["vocab_size"] + 1000
    assert config["bos_token_id"] == source["bos_token_id"] and config["max_position_embeddings"] == 1024
    assert json.loads((merged / "generation_config.json").read_text()) == generation
    # The checkpoint's own template is the default (what transformers and vLLM format requests with); the
    # training one is named beside it.
    assert tokenizer.chat_template == {"default": HUB_TEMPLATE, "training": TRAINING_TEMPLATES["chatml"]}
    chat = [{"role": "user", "content": "2+2="}]
    assert tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True).startswith(
        "<|im_start|>system\nYou are a helpful assistant.")
    model = transformers.AutoModelForCausalLM.from_pretrained(merged)
    assert model.generation_config.temperature == GENERATION["temperature"]
    assert model.config.max_position_embeddings == 1024
    assert sorted(p.name for p in (workdir / "source").iterdir()) == ["chat_template.jinja", "config.json",
                                                                      "generation_config.json"]


def test_the_adapter_on_the_resized_base_gives_the_merged_exports_logits(exported):
    _, _, base, merged, adapter, _ = exported
    tokenizer = transformers.AutoTokenizer.from_pretrained(adapter)
    # Coordinate tokens and the task's text: the added rows are read.
    ids = tokenizer("<12> 3+4= <1000> 7-2+1= <0>", return_tensors="pt").input_ids
    assert (ids >= json.loads((base / "config.json").read_text())["vocab_size"]).sum() >= 3
    want, got = merged_and_adapter_logits(transformers.AutoModelForCausalLM, base, merged, adapter, ids)
    assert np.abs(got - want[..., :len(tokenizer)]).max() <= 1e-4
    assert tokenizer.chat_template["default"] == HUB_TEMPLATE  # the adapter's tokenizer, as the merged one


@pytest.fixture(scope="module")
def exported_vl(vl_checkpoint, tmp_path_factory):
    """The same for a LoRA VFlash run on a tiny Qwen2.5-VL saved with a hub template and generation config
    (VFlash adds the coordinate tokens <0>…<1000> and tags): (source config, base, merged, adapter)."""
    root = tmp_path_factory.mktemp("roundtrip-vl")
    base = root / "base"
    shutil.copytree(vl_checkpoint("qwen2_5_vl")[0], base)
    (base / "chat_template.jinja").write_text(HUB_TEMPLATE)
    source = json.loads((base / "config.json").read_text())
    text = source["text_config"]
    (base / "generation_config.json").write_text(json.dumps({
        "bos_token_id": text["bos_token_id"], "eos_token_id": [text["eos_token_id"], text["pad_token_id"]],
        "pad_token_id": text["pad_token_id"], **GENERATION}))
    shards = root / "shards"
    run_module("data_pipeline.convert", "--format=vflash", f"--input={ROOT / 'data/smoke/vflash/eval.jsonl'}",
               f"--output={shards}", f"--tokenizer={base}", "--template-family=chatml")
    workdir = root / "run"
    run_train("configs/vflash.py:hf,lora", workdir, f"--config.model.init_from={base}", f"--config.data.tokenizer={base}",
              "--config.data.format=vflash", f"--config.data.train={shards}", f"--config.data.eval={shards}",
              "--config.data.allow_overlap=True", "--config.train.steps=2", "--config.train.checkpoint_every=2",
              "--config.train.log_every=1", "--config.train.warmup_steps=1", "--config.train.learning_rate=2e-2",
              "--config.model.dtype=float32", "--config.eval.at_end=False", "--config.eval.every=0",
              "--config.data.global_batch=4", "--config.data.seq_len=256", "--config.model.lora.rank=4", timeout=900)
    merged, adapter = root / "merged", root / "adapter"
    run_module("valen_jax.export", f"--workdir={workdir}", f"--output={merged}", timeout=600)
    run_module("valen_jax.export", f"--workdir={workdir}", f"--output={adapter}", "--adapter", timeout=600)
    return source, base, merged, adapter


def test_a_qwen2_5_vl_export_keeps_the_source_and_its_adapter_gives_the_merged_logits(exported_vl):
    from data_pipeline.chat_templates import TRAINING_TEMPLATES

    source, base, merged, adapter = exported_vl
    config = json.loads((merged / "config.json").read_text())
    tokenizer = transformers.AutoTokenizer.from_pretrained(adapter)
    assert len(tokenizer) > source["text_config"]["vocab_size"] + 1000  # the coordinate tokens were added
    changed = {key for key in source if config.get(key) != source[key]}
    assert changed == {"text_config"}, changed
    text_changed = {key for key in source["text_config"] if config["text_config"].get(key) != source["text_config"][key]}
    assert text_changed == {"vocab_size"}, text_changed
    assert json.loads((merged / "generation_config.json").read_text())["temperature"] == GENERATION["temperature"]
    # (AutoProcessor reads the same files; it needs torchvision for Qwen's video processor, not installed here.)
    exported_tokenizer = transformers.AutoTokenizer.from_pretrained(merged)
    assert exported_tokenizer.chat_template == {"default": HUB_TEMPLATE, "training": TRAINING_TEMPLATES["chatml"]}

    ids = tokenizer("<12> <1000> the point <point> <0>", return_tensors="pt").input_ids
    want, got = merged_and_adapter_logits(transformers.AutoModelForImageTextToText, base, merged, adapter, ids)
    assert np.abs(got - want[..., :len(tokenizer)]).max() <= 1e-4

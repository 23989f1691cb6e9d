"""A user's first hour, in files: a tiny random text checkpoint shaped like a hub one, and their own chat JSONL.

`make_text_checkpoint(directory)` writes a tiny random Qwen2 (transformers `Qwen2Config`,
`save_pretrained`) and a fast BPE tokenizer whose `chat_template` is Qwen2.5-Instruct's inference template
(`QWEN2_5_TEMPLATE`: no `{% generation %}` markers, as on every hub checkpoint); `with_hub_template` gives
another tokenizer (a Qwen2.5-VL one: `QWEN2_5_VL_TEMPLATE`) its hub template. `write_chat(path, rows)`
writes chat rows; `OWN_TRAIN` / `OWN_EVAL` are a user's conversations, one with a tool call.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.hub_checkpoints import chat_template

ROOT = Path(__file__).resolve().parents[1]

# The hub chat templates of Qwen2.5-Instruct and Qwen2.5-VL-Instruct (tests/fixtures/hub, PROVENANCE.md there).
QWEN2_5_TEMPLATE = chat_template("qwen2_5")
QWEN2_5_VL_TEMPLATE = chat_template("qwen2_5_vl")

_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                              "parameters": {"type": "object",
                                                             "properties": {"city": {"type": "string"}},
                                                             "required": ["city"]}}}


def _tool_row(city: str, report: str, call_id: str) -> dict:
    return {"tools": [_WEATHER], "messages": [
        {"role": "user", "content": f"What is the weather in {city}?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}]},
        {"role": "tool", "tool_call_id": call_id, "name": "get_weather", "content": report},
        {"role": "assistant", "content": f"It is {report} in {city}."}]}


def _sum_row(a: int, b: int) -> dict:
    return {"messages": [{"role": "system", "content": "You add numbers."},
                         {"role": "user", "content": f"What is {a} plus {b}?"},
                         {"role": "assistant", "content": str(a + b)}]}


OWN_TRAIN = [_tool_row("Lima", "18C and sunny", "call_1"), *(_sum_row(a, 7 * a % 50) for a in range(3, 10)),
             _tool_row("Oslo", "2C and snowing", "call_2")]
OWN_EVAL = [_sum_row(11, 13), _tool_row("Quito", "14C and cloudy", "call_3")]


def write_chat(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def image_row(image: str) -> dict:
    """A chat row whose user message holds an image part (`image`: a path relative to the JSONL)."""
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": "What color is the shape?"},
                                                      {"type": "image", "path": image}]},
                         {"role": "assistant", "content": "A blue square."}]}


def with_hub_template(tokenizer_dir: Path, directory: Path, template: str) -> Path:
    """A copy of the tokenizer in `tokenizer_dir` whose chat template is `template` (a hub checkpoint's)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.chat_template = template
    tokenizer.save_pretrained(directory)
    return Path(directory)


def make_text_checkpoint(directory: Path) -> Path:
    """Write a tiny random Qwen2 with a Qwen2.5-Instruct-templated tokenizer into `directory`."""
    texts = [json.dumps(row) for row in OWN_TRAIN + OWN_EVAL]
    tiny_qwen2(directory, texts, QWEN2_5_TEMPLATE)
    return Path(directory)


def tiny_qwen2(directory: Path, texts: list[str], template: str) -> int:
    """A tiny random Qwen2 (tied head) and a byte-level BPE tokenizer learnt from `texts` plus the VFlash smoke
    prompts, with `template` as its chat template, saved into `directory`; returns the tokenizer's length."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = list(texts) + [json.loads(line)["conversations"][0]["value"]
                           for line in (ROOT / "data/smoke/vflash/points.jsonl").read_text().splitlines()]
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(texts * 5, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = template
    tokenizer.save_pretrained(directory)
    config = transformers.Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return len(tokenizer)

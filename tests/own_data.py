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

ROOT = Path(__file__).resolve().parents[1]

# The `chat_template` of Qwen/Qwen2.5-0.5B-Instruct's tokenizer_config.json (the same in every Qwen2.5
# Instruct size), as published on the Hugging Face hub; written here verbatim (nothing is fetched).
QWEN2_5_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are "
    "provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n            {{- '\\n' + message.content }}\n        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n"
)

# The `chat_template` of Qwen/Qwen2.5-VL-3B-Instruct (chat_template.json; Qwen2-VL's is the same), as
# published on the Hugging Face hub; written here verbatim.
QWEN2_5_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content "
    "%}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}"
)

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
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    directory = Path(directory)
    texts = [json.dumps(row) for row in OWN_TRAIN + OWN_EVAL]
    texts += [json.loads(line)["conversations"][0]["value"]
              for line in (ROOT / "data/smoke/vflash/points.jsonl").read_text().splitlines()]
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(texts * 5, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = QWEN2_5_TEMPLATE
    tokenizer.save_pretrained(directory)
    config = transformers.Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory

"""The first hour with a hub checkpoint, per family, as the README's own-data walkthrough runs it.

A tiny random checkpoint shaped like the hub one (`tests/hub_checkpoints.py`: the family's own chat template,
without `{% generation %}` markers, its special tokens, config and generation config), the user's own chat
JSONL with a tool call (and images for the VL families), then exactly the commands a user types:

    python -m valen_jax.train --config=configs/chat.py:hf,lora --workdir=W \
        --config.model.init_from=CKPT --config.data.tokenizer=CKPT \
        --config.data.train=train.jsonl --config.data.eval=eval.jsonl
    python -m valen_jax.evaluate --workdir=W --data=eval.jsonl --output=report.json
    python -m valen_jax.export --workdir=W --output=merged
    python -m valen_jax.export --workdir=W --output=adapter --adapter

then the merged export and the adapter (on the base, as PEFT loads it) reloaded in transformers with equal
logits and the checkpoint's own fields kept, and the served workdir driven by the `openai` client through a
tool-calling loop (call → `json.loads(arguments)` → the tool's result sent back → the final answer), streamed
and not. The training set repeats one tool-calling conversation so that the tiny model learns it by heart in
a few dozen steps: the loop then exercises a real call the model makes, not one a test injected.

The train/evaluate/export runs are built once per family and run (tests/once_per_run.py); Qwen2.5 and
Qwen2.5-VL run in `make test` (slow), the other families in `make test-all` (heavy).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.export_loading import merged_and_adapter_logits
from tests.hub_checkpoints import VL_FAMILIES, chat_template, make_hub_checkpoint
from tests.once_per_run import build_once

ROOT = Path(__file__).resolve().parents[1]
SMOKE_IMAGE = ROOT / "data/smoke/chat/images/shape_003.png"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Look up the current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
QUESTION = "What is the weather in Osaka?"
RESULT = "15C and raining"
ANSWER = "It is 15C and raining in Osaka."
STEPS = 60
FAMILY_PARAMS = [
    pytest.param("qwen2_5", marks=pytest.mark.slow),
    pytest.param("qwen2_5_vl", marks=pytest.mark.slow),
    pytest.param("qwen3", marks=pytest.mark.heavy),
    pytest.param("llama3_1", marks=pytest.mark.heavy),
    pytest.param("qwen3_vl", marks=pytest.mark.heavy),
]


def _user_content(vision: bool, text: str):
    if not vision:
        return text
    return [{"type": "image", "path": "images/weather.png"}, {"type": "text", "text": text}]


def write_own_data(directory: Path, vision: bool) -> tuple[Path, Path]:
    """train.jsonl / eval.jsonl as a user writes them (seed 003 chat rows): the tool-calling conversation,
    and a plain question, with an image in each user turn for a VL family."""
    directory.mkdir(parents=True, exist_ok=True)
    if vision:
        (directory / "images").mkdir(exist_ok=True)
        shutil.copy(SMOKE_IMAGE, directory / "images/weather.png")
    tool_row = {"tools": TOOLS, "messages": [
        {"role": "user", "content": _user_content(vision, QUESTION)},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Osaka"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": RESULT},
        {"role": "assistant", "content": ANSWER}]}
    plain_row = {"messages": [{"role": "user", "content": _user_content(vision, "What is 40 plus 32?")},
                              {"role": "assistant", "content": "72"}]}
    train, evaluation = directory / "train.jsonl", directory / "eval.jsonl"
    train.write_text("".join(json.dumps(plain_row if k % 4 == 0 else tool_row) + "\n" for k in range(16)))
    evaluation.write_text("".join(json.dumps(row) + "\n" for row in (tool_row, plain_row)))
    return train, evaluation


def run_command(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, f"{' '.join(args[:2])} exited {done.returncode}:\n{done.stderr[-3000:]}"
    return done


# The README's own-data walkthrough, as a user copies it; swapped for the test: the hub name for the tiny local
# checkpoint, my_data/ and runs/my-chat for temp folders, and the train command sized for this CPU (the
# defaults are a real run's: 1,000 steps in bf16).
HUB_NAME, DATA, WORKDIR = "Qwen/Qwen2.5-7B-Instruct", "my_data/", "runs/my-chat"
CPU_SIZED = (f"--config.train.steps={STEPS}", "--config.train.learning_rate=3e-2", "--config.data.global_batch=4",
             "--config.data.seq_len=512", "--config.model.dtype=float32", "--config.eval.every=0",
             "--config.train.checkpoint_every=1000")


def walkthrough_commands() -> list[list[str]]:
    """The commands of the README block after the `own-data walkthrough` marker, each as argv."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = text[text.index("own-data walkthrough"):]
    block = block[block.index("```bash\n") + len("```bash\n"):]
    block = block[:block.index("```")]
    return [shlex.split(line) for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def first_hour(directory: Path, family: str) -> dict:
    """Everything a user runs in the first hour, up to the exports (built once per family and run)."""
    checkpoint = directory / "checkpoint"
    info = make_hub_checkpoint(checkpoint, family)
    data = directory / "my_data"
    write_own_data(data, info["vision"])
    workdir = directory / "runs/my-chat"
    logs = {}
    for argv in walkthrough_commands():
        assert argv[:2] == ["python", "-m"], argv
        module = argv[2]
        if module == "valen_jax.serve":
            continue  # served in-process by the tool-calling test below, through the same load_service
        args = [arg.replace(HUB_NAME, str(checkpoint)).replace(DATA, f"{data}/").replace(WORKDIR, str(workdir))
                for arg in argv[3:]]
        if module == "valen_jax.train":
            args += CPU_SIZED
        logs[module] = run_command(module, *args).stderr[-4000:]
    return {"family": family, "checkpoint": str(checkpoint), "workdir": str(workdir),
            "report": str(workdir / "report.json"), "merged": str(workdir / "merged"),
            "adapter": str(workdir / "adapter"), "train_log": logs["valen_jax.train"], "vision": info["vision"],
            "eval_data": str(data / "eval.jsonl")}


def test_the_walkthrough_is_the_four_keys_then_evaluate_export_serve():
    commands = walkthrough_commands()
    assert [argv[2] for argv in commands] == ["valen_jax.train", "valen_jax.evaluate", "valen_jax.export",
                                               "valen_jax.export", "valen_jax.serve"]
    train = commands[0]
    assert {arg.split("=")[0] for arg in train if arg.startswith("--config.")} == {
        "--config.model.init_from", "--config.data.tokenizer", "--config.data.train", "--config.data.eval"}


@pytest.fixture(scope="module")
def first_hour_run(tmp_path_factory):
    def run(family: str) -> dict:
        _, result = build_once(tmp_path_factory, f"first-hour-{family}",
                               lambda directory: first_hour(directory, family))
        return result

    return run


@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_train_on_own_data_then_evaluate(first_hour_run, family):
    run = first_hour_run(family)
    report = json.loads(Path(run["report"]).read_text())
    # The report and the end of training's log name what was evaluated: the user's file, not a bundled one.
    assert report["data"] == run["eval_data"], report["data"]
    assert any(run["eval_data"] in line for line in run["train_log"].splitlines()[-4:]), run["train_log"][-800:]
    assert report["tool_call_exact_match"] == 1.0 and report["answer_exact_match"] == 1.0, report


def _logits_inputs(run: dict):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(run["merged"])
    text = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], tools=TOOLS,
                                         add_generation_prompt=True, tokenize=False) + '<tool_call>\n{"name"'
    return tokenizer, tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]


def _auto_class(run: dict):
    import transformers

    return transformers.AutoModelForImageTextToText if run["vision"] else transformers.AutoModelForCausalLM


@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_exports_reload_in_transformers_and_peft(first_hour_run, family):
    run = first_hour_run(family)
    merged_dir, adapter_dir, base_dir = Path(run["merged"]), Path(run["adapter"]), Path(run["checkpoint"])
    tokenizer, ids = _logits_inputs(run)
    merged_logits, adapter_logits = merged_and_adapter_logits(_auto_class(run), base_dir, merged_dir, adapter_dir, ids)
    # The merged export pads its vocabulary to a multiple of 128 (as hub checkpoints do); the tokenizer's ids are
    # what both answer for.
    vocabulary = len(tokenizer)
    assert adapter_logits.shape[-1] == vocabulary and merged_logits.shape[-1] >= vocabulary
    np.testing.assert_allclose(adapter_logits, merged_logits[..., :vocabulary], atol=1e-4, rtol=0)

    # What a serving stack reads from the folder is the checkpoint's own, where training did not change it.
    source = json.loads((base_dir / "config.json").read_text())
    exported = json.loads((merged_dir / "config.json").read_text())
    text_source, text_exported = source.get("text_config", source), exported.get("text_config", exported)
    for key in ("max_position_embeddings", "bos_token_id", "eos_token_id", "rope_scaling", "tie_word_embeddings"):
        if key in text_source:
            assert text_exported.get(key) == text_source[key], (key, text_exported.get(key), text_source[key])
    source_generation = json.loads((base_dir / "generation_config.json").read_text())
    exported_generation = json.loads((merged_dir / "generation_config.json").read_text())
    for key in ("eos_token_id", "bos_token_id", "temperature", "top_p", "top_k", "repetition_penalty", "do_sample"):
        assert exported_generation.get(key) == source_generation.get(key), key
    # Inference templates: the checkpoint's own is the default one (what HF and vLLM render with); the training
    # template is kept beside it by name.
    assert tokenizer.get_chat_template() == chat_template(family)
    assert "{%- generation -%}" in tokenizer.get_chat_template("training")


def _openai_messages(vision: bool, text: str) -> list[dict]:
    if not vision:
        return [{"role": "user", "content": text}]
    import base64

    url = "data:image/png;base64," + base64.b64encode(SMOKE_IMAGE.read_bytes()).decode()
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


def _streamed(client, model: str, messages: list[dict]) -> tuple[str, list[dict], str]:
    """A streamed answer assembled as OpenAI's documentation does: content deltas joined, tool-call deltas
    merged by `index` (id/type/name from the first delta of a call, argument pieces appended)."""
    content, calls, finish = [], {}, None
    for chunk in client.chat.completions.create(model=model, messages=messages, tools=TOOLS, stream=True):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        if choice.delta.content:
            content.append(choice.delta.content)
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": None, "type": None, "name": "", "arguments": ""})
            call["id"] = delta.id or call["id"]
            call["type"] = delta.type or call["type"]
            if delta.function is not None:
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
    return "".join(content), [calls[k] for k in sorted(calls)], finish


@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_served_tool_calling_loop_with_the_openai_client(first_hour_run, family):
    import openai

    from tests.serve_server import Served

    run = first_hour_run(family)
    served = Served(run["workdir"], slots=2, max_queue=4)
    try:
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused")
        model = client.models.list().data[0].id
        messages = _openai_messages(run["vision"], QUESTION)

        first = client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content, choice
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Osaka"}

        content, streamed_calls, finish = _streamed(client, model, messages)
        assert "<tool_call>" not in content and not content.strip(), content
        assert finish == "tool_calls" and len(streamed_calls) == 1
        assert streamed_calls[0]["type"] == "function" and streamed_calls[0]["id"]
        assert streamed_calls[0]["name"] == "get_weather"
        assert json.loads(streamed_calls[0]["arguments"]) == json.loads(call.function.arguments)

        messages = messages + [choice.message.model_dump(exclude_none=True),
                               {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
        final = client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
        assert final.choices[0].finish_reason == "stop"
        assert final.choices[0].message.content == ANSWER and not final.choices[0].message.tool_calls
        content, streamed_calls, finish = _streamed(client, model, messages)
        assert (content, streamed_calls, finish) == (ANSWER, [], "stop")
    finally:
        served.close()


def test_fixture_templates_are_the_hub_files():
    """The templates under tests/fixtures/hub are the hub's, byte for byte as taken (PROVENANCE.md there),
    and none of them has generation markers: the point of testing with them."""
    import hashlib

    expected = {
        "llama3_1": "e10ca381b1ccc5cf9db52e371f3b6651576caee0a630b452e2816b2d404d4b65",
        "llama3_2": "5816fce10444e03c2e9ee1ef8a4a1ea61ae7e69e438613f3b17b69d0426223a4",
        "qwen2_5": "cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f",
        "qwen2_5_vl": "a0bc6f6fc7a29a80017a433e8f03a1cc1236e838a944a2d034295a60c4f2fddb",
        "qwen3": "87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5",
        "qwen3_vl": "3636d0f0bd6bef02654cdffdc447b79cb2cef8ab02cc75267345946291a489e4",
    }
    for family, digest in expected.items():
        text = chat_template(family)
        assert hashlib.sha256(text.encode()).hexdigest() == digest, family
        assert "{% generation %}" not in text and "{%- generation %}" not in text


@pytest.mark.parametrize("family", ["qwen2_5", "qwen3", "llama3_1", "llama3_2", *VL_FAMILIES])
def test_hub_checkpoints_render_a_tool_call_as_their_family_does(tmp_path, family):
    """The fixture tokenizer renders the tool-calling conversation with the hub template (Qwen2.5-VL's template
    has no tool section: its calls are dropped, as on the hub), and encodes the family's control tokens as
    single tokens."""
    from tests.hub_checkpoints import build_tokenizer

    tokenizer = build_tokenizer(tmp_path, family)
    messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Osaka"}}}]}]
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    if family.startswith("llama"):
        assert '{"name": "get_weather", "parameters": {"city": "Osaka"}}<|eot_id|>' in text
        assert len(tokenizer("<|start_header_id|>", add_special_tokens=False)["input_ids"]) == 1
    elif family == "qwen2_5_vl":
        assert "<tool_call>" not in text and text.count("<|im_start|>") == 3
    else:
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Osaka"}}\n</tool_call>' in text
        assert tokenizer.convert_tokens_to_ids("<tool_call>") != tokenizer.unk_token_id

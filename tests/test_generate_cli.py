"""`python -m valen_jax.generate`, predict on generated formats, and the library `generate` (issue 15).

The CLI runs against the session's tiny trained workdirs (tests/smoke_workdirs.py) on the smoke data;
its lines are checked against the data itself (one line per trained assistant answer, in data order),
against evaluation's greedy decoding of the prompts it builds itself (`prompts.prompt_of`), and against
seed 004's dequantisation.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from data_pipeline.primitives import coordinates, dequantise, parse_answer
from data_pipeline.tokenizer import end_of_turn_id, load_tokenizer
from tests.smoke_workdirs import smoke_workdir
from tests.train_runs import ROOT, run_module
from valen_jax import generate as generate_cli
from valen_jax import predict
from valen_jax.decoding.engine import generate_ids
from valen_jax.decoding.sampling import Sampling
from valen_jax.evaluation import answers, tokens
from valen_jax.evaluation import workdir as eval_workdir
from valen_jax.evaluation.prompts import prompt_of
from valen_jax.models.config import ModelConfig
from valen_jax.models.transformer import Transformer
from valen_jax.run import restore_model
from valen_jax.training import checkpoint

VFLASH_DATA = ROOT / "data/smoke/vflash/eval.jsonl"
CHAT_DATA = ROOT / "data/smoke/chat/eval.jsonl"
VALEN_DATA = ROOT / "data/smoke/valen/train.jsonl"


def _read(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def vflash_workdir(tmp_path_factory):
    return smoke_workdir(tmp_path_factory, "configs/vflash.py:tiny")


@pytest.fixture(scope="module")
def chat_workdir(tmp_path_factory):
    return smoke_workdir(tmp_path_factory, "configs/chat.py:tiny", "--config.train.steps=4")


@pytest.fixture(scope="module")
def vflash_cli(vflash_workdir, tmp_path_factory):
    """The CLI as a user runs it, with every default (greedy, the checkpoint's eval.max_new_tokens)."""
    output = tmp_path_factory.mktemp("generate") / "answers.jsonl"
    result = run_module("valen_jax.generate", f"--workdir={vflash_workdir}", f"--data={VFLASH_DATA}",
                        f"--output={output}", timeout=600)
    return output, result.stdout


@pytest.mark.heavy
def test_cli_writes_one_line_per_trained_answer_in_data_order(vflash_cli):
    output, stdout = vflash_cli
    lines = _read(output)
    records = _read(VFLASH_DATA)
    # Seed 004 rows: every `gpt` turn is a trained answer (the box rows ask one category per turn).
    expected = [(i, k) for i, record in enumerate(records)
                for k in range(sum(turn["from"] == "gpt" for turn in record["conversations"]))]
    assert len(expected) == 19 and [(line["index"], line["answer"]) for line in lines] == expected
    assert f"{len(expected)} answers of {len(records)} records generated" in stdout
    for line in lines:
        assert line["source"] == f"{VFLASH_DATA}:{line['index'] + 1}" and line["id"] is None
        assert line["finish_reason"] in ("stop", "length") and 1 <= line["generated_tokens"] <= 16
        if line["finish_reason"] == "length":
            assert line["generated_tokens"] == 16  # the checkpoint's eval.max_new_tokens
        assert set(line) == {"index", "source", "id", "answer", "text", "finish_reason", "generated_tokens",
                             "primitives", "atomic_decoding", "parse_error"}


@pytest.mark.heavy
def test_cli_primitives_are_the_parsed_text_dequantised(vflash_cli):
    for line in _read(vflash_cli[0]):
        try:
            primitives, calls = parse_answer(line["text"])
        except ValueError as error:
            assert line["parse_error"] == str(error) and line["primitives"] == []
            continue
        assert line["parse_error"] is None and len(line["primitives"]) == len(primitives)
        assert len(line["atomic_decoding"]) == len(calls)
        for got, primitive in zip(line["primitives"], primitives, strict=True):
            assert got["kind"] == primitive.kind and got["tokens"] == list(primitive.values)
            assert np.allclose(got["coordinates"], coordinates(primitive))


@pytest.mark.heavy
def test_cli_greedy_equals_evaluations_greedy_on_the_same_prompts(vflash_cli, vflash_workdir):
    lines = _read(vflash_cli[0])
    restored = restore_model(vflash_workdir)
    tokenizer, spec, mesh = restored.tokenizer, restored.spec, restored.mesh
    eot = end_of_turn_id(tokenizer)
    with jax.set_mesh(mesh):
        fmt, options = eval_workdir.data_format(restored, None)
        examples, _, _ = eval_workdir.load_examples(fmt, VFLASH_DATA, restored.workdir,
                                                    checkpoint.tokenizer_dir(restored.workdir), restored.fingerprint, options)
        prompts = [prompt_of(examples[line["index"]], spec, eot, line["answer"]) for line in lines]
        local_batch = eval_workdir.local_batch_size(8, mesh)
        ids = tokens.greedy(restored.params, restored.graphdef, prompts, spec, mesh, local_batch,
                            -(-len(prompts) // local_batch), 16, eot, len(tokenizer))
    for line, row in zip(lines, ids, strict=True):
        assert (line["text"], line["generated_tokens"]) == (tokens.decode(tokenizer, row, eot), len(row))
        assert line["finish_reason"] == ("stop" if row[-1] == eot else "length")


@pytest.mark.heavy
def test_predict_on_vflash_data_writes_the_lines_of_generate(vflash_cli, vflash_workdir, tmp_path, capsys):
    output = tmp_path / "predicted.jsonl"
    assert predict.main([f"--workdir={vflash_workdir}", f"--data={VFLASH_DATA}", f"--output={output}"]) == 0
    assert "19 answers of 16 records generated (greedy)" in capsys.readouterr().out
    assert output.read_bytes() == vflash_cli[0].read_bytes()


def _sampled(workdir, output, seed: int) -> bytes:
    """The chat smoke set sampled at temperature 1 in this process, as the CLI writes it."""
    assert generate_cli.main([f"--workdir={workdir}", f"--data={CHAT_DATA}", f"--output={output}",
                              "--temperature=1", "--max-new-tokens=4", f"--seed={seed}"]) == 0
    return output.read_bytes()


@pytest.fixture(scope="module")
def sampled_chat(chat_workdir, tmp_path_factory):
    return _sampled(chat_workdir, tmp_path_factory.mktemp("sampled") / "a.jsonl", 5)


@pytest.mark.heavy
def test_same_seed_same_file_another_seed_another(chat_workdir, sampled_chat, tmp_path):
    assert _sampled(chat_workdir, tmp_path / "b.jsonl", 5) == sampled_chat
    assert _sampled(chat_workdir, tmp_path / "c.jsonl", 6) != sampled_chat
    lines = _read(tmp_path / "b.jsonl")
    records = _read(CHAT_DATA)
    assert [(line["index"], line["answer"]) for line in lines] == [
        (i, k) for i, record in enumerate(records)
        for k in range(sum(m["role"] == "assistant" for m in record["messages"]))]
    assert all(isinstance(line["tool_calls"], list) and "primitives" not in line for line in lines)


@pytest.mark.heavy
def test_two_processes_write_the_file_of_one(chat_workdir, sampled_chat, tmp_path):
    """launch/local.py's job of 2 processes × 1 CPU device over gloo: each generates its block of
    answers, process 0 writes them all in data order, and the sampled tokens are those of one process."""
    spec = importlib.util.spec_from_file_location("launch_local", ROOT / "launch" / "local.py")
    local = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(local)
    output = tmp_path / "two.jsonl"
    code = local.launch(2, 1, [f"--workdir={chat_workdir}", f"--data={CHAT_DATA}", f"--output={output}",
                               "--temperature=1", "--max-new-tokens=4", "--seed=5"],
                        command=(sys.executable, "-m", "valen_jax.generate"))
    assert code == 0
    assert output.read_bytes() == sampled_chat


@pytest.mark.heavy
def test_valen_data_is_refused_with_a_pointer_to_predict(vflash_workdir, tmp_path, capsys):
    output = tmp_path / "answers.jsonl"
    code = generate_cli.main([f"--workdir={vflash_workdir}", f"--data={VALEN_DATA}", "--format=valen",
                              f"--output={output}"])
    err = capsys.readouterr().err
    assert code == 2 and not output.exists()
    assert f"{VALEN_DATA}: Valen data is scored, not generated" in err and "python -m valen_jax.predict" in err


def test_bad_sampling_flags_name_the_flag(tmp_path):
    with pytest.raises(SystemExit, match="--temperature=0.0 --top-k=0 --top-p=0.5: .*needs temperature > 0"):
        generate_cli.main([f"--workdir={tmp_path}", f"--data={tmp_path}", f"--output={tmp_path / 'a'}",
                           "--top-p=0.5"])
    with pytest.raises(SystemExit, match="--max-new-tokens=0: must be >= 1"):
        generate_cli.main([f"--workdir={tmp_path}", f"--data={tmp_path}", f"--output={tmp_path / 'a'}",
                           "--max-new-tokens=0"])


def test_vflash_coordinates_by_hand():
    # Seed 004 ranges: image [0, 1000] -> fractions; camera x, y in [-5, 5] m and z in [0, 10] m;
    # ego x in [-10, 250] m, y in [-65, 65] m, heading in [-pi, pi]; dense (k - 500) * s / 500 m.
    call = '<tool_call>{"name":"atomic_decoding","arguments":{"block_size":5}}</tool_call>'
    text = ('<point><218><365></point><tool_call>{"name":"atomic_decoding","arguments":{"block_size":5}}'
            '</tool_call><robot_single><521><489><61></robot>'
            f'{call}<drive><62><500><1000></drive>{call}<dense><500><750><0></dense>')
    fields = answers.vflash_fields(text, dense_scale=2.0)
    assert fields["parse_error"] is None
    point, robot, drive, dense = fields["primitives"]
    close = np.testing.assert_allclose
    close(point["coordinates"], [[0.218, 0.365]])
    close(robot["coordinates"], [[0.21, -0.11, 0.61]])  # -5 + 521 * 10 / 1000, -5 + 489 / 100, 61 / 100
    close(drive["coordinates"], [[-10 + 62 * 0.26, 0.0, np.pi]])
    close(dense["coordinates"], [[0.0, 1.0, -2.0]], atol=1e-12)
    assert (point["units"], robot["units"]) == ("image fraction (x, y)", "camera frame m (x, y, z)")
    assert robot["coordinates"][0][2] == dequantise(61, 0.0, 10.0)
    assert fields["atomic_decoding"] == [{"block_size": 5, "count": None, "covers": [k]} for k in (1, 2, 3)]
    # No dense scale in the data: no metres, said per primitive; the other primitives keep theirs.
    unscaled = answers.vflash_fields(text, dense_scale=None)["primitives"]
    assert unscaled[3]["coordinates"] is None and "dense_scale" in unscaled[3]["error"]
    assert unscaled[1]["coordinates"] == robot["coordinates"]
    broken = answers.vflash_fields("<point><1><2>", dense_scale=None)
    assert broken["primitives"] == [] and broken["parse_error"] == "at char 0: <point> is not closed by </point>"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ROOT / "data/tokenizer")


def test_an_answer_line_reads_tool_calls_and_its_stop(tokenizer):
    from data_pipeline.shards import Example

    eot = end_of_turn_id(tokenizer)
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Nairobi"}}\n</tool_call>'
    ids = tokenizer.encode(text, add_special_tokens=False) + [eot]
    example = Example({"input_ids": np.zeros(2, np.int32), "target_weights": np.zeros(2, np.float32)},
                      {"format": "vakforge", "source": "m.jsonl", "line": 3, "entry": "eval", "id": "conv_1"})
    line = answers.answer_line(example, 2, 1, ids, family="vakforge", tokenizer=tokenizer, stop_ids=(eot,),
                               chat_family="chatml")
    assert line == {"index": 2, "source": "m.jsonl:3", "id": "conv_1", "answer": 1, "text": text,
                    "finish_reason": "stop", "generated_tokens": len(ids),
                    "tool_calls": [{"name": "get_weather", "arguments": {"city": "Nairobi"}}]}
    cut = answers.answer_line(example, 2, 1, ids[:-3], family="chat", tokenizer=tokenizer, stop_ids=(eot,),
                              chat_family="chatml")
    assert cut["finish_reason"] == "length" and len(cut["tool_calls"]) == 1 and isinstance(cut["tool_calls"][0], str)


def test_host_blocks_cover_every_answer_once():
    for count in (0, 1, 7, 19):
        for processes in (1, 2, 3, 4):
            blocks = [answers.host_block(count, p, processes) for p in range(processes)]
            assert [j for block in blocks for j in block] == list(range(count))
            assert max(map(len, blocks)) == -(-count // processes)


@pytest.fixture(scope="module")
def tiny_model(tokenizer):
    cfg = ModelConfig(vocab_size=len(tokenizer) + 13, dim=32, num_layers=2, num_heads=2, num_kv_heads=1,
                      head_dim=16, mlp_dim=64)
    return Transformer(cfg, nnx.Rngs(0))


def test_library_generate_returns_text_with_a_tokenizer_and_ids_without(tiny_model, tokenizer):
    from valen_jax.generate import generate

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "And doubled?"}]
    texts = generate(tiny_model, ["What is 4 plus 23?", messages], tokenizer=tokenizer, max_new_tokens=6)
    assert len(texts) == 2 and all(isinstance(t, str) and t for t in texts)
    eot = end_of_turn_id(tokenizer)
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    [ids] = generate(tiny_model, [prompt], max_new_tokens=6, stop_ids=[eot])
    assert all(isinstance(t, int) for t in ids) and 1 <= len(ids) <= 6
    assert texts[1] == tokenizer.decode([t for t in ids if t != eot], skip_special_tokens=False,
                                        clean_up_tokenization_spaces=False)
    # Stopping keeps the stop token in the ids: stop on the first greedy token gives just that token.
    [free] = generate(tiny_model, [prompt], max_new_tokens=4, stop_ids=[])
    assert len(free) == 4 and generate(tiny_model, [prompt], max_new_tokens=4, stop_ids=[free[0]]) == [free[:1]]
    with pytest.raises(ValueError, match=r"prompts\[0\]: text and chat-message prompts need tokenizer="):
        generate(tiny_model, ["hello"], max_new_tokens=2)


def test_sampled_answers_do_not_depend_on_how_hosts_split_them(tiny_model, tokenizer):
    """Each process generates a contiguous block with first_index = its start (evaluation.answers), so
    the tokens of answer j come from the stream of j whether one process or three generate them."""
    graphdef, state = nnx.split(tiny_model)
    params = nnx.to_pure_dict(state)
    rng = np.random.default_rng(0)
    prompts = [{"ids": (ids := rng.integers(5, len(tokenizer), size=n).astype(np.int32)),
                "positions": np.arange(len(ids), dtype=np.int32)} for n in (3, 9, 4, 12, 5, 7, 6)]
    sampling = Sampling(temperature=1.0, top_k=50)
    kwargs = dict(max_new_tokens=5, stop_ids=(), vocab=len(tokenizer), sampling=sampling, seed=11)
    # One batch shape everywhere (2 rows, one bucket): one compiled program for the whole test.
    whole = generate_ids(params, graphdef, prompts, **kwargs, local_batch=2)
    split = []
    for p in range(3):
        block = answers.host_block(len(prompts), p, 3)
        split += generate_ids(params, graphdef, prompts[block.start:block.stop], **kwargs, local_batch=2,
                              batches=2, first_index=block.start)
    assert split == whole
    assert generate_ids(params, graphdef, prompts, **{**kwargs, "seed": 12}, local_batch=2) != whole

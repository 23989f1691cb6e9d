"""Issue 54, the train path: a hub-shaped checkpoint (a real Qwen2.5 chat template, no generation markers) and
the user's own files train with the four keys the configs document, and every mistake on the way is one line.

1. The template family reaches every conversion a run makes (train and eval, chat and VFlash).
2. A text checkpoint gets no vision tower (seed 003): image rows are refused before any device is claimed,
   naming PATH:LINE and the key; `--config.model.vision=None` is accepted; the text run exports.
3. Own training data beside the bundled smoke eval set is refused, naming config.data.eval; the log's last
   line names what was evaluated.
4. A JSONL where the config reads a recipe names the format key and the format that reads it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.own_data import (
    OWN_EVAL,
    OWN_TRAIN,
    QWEN2_5_VL_TEMPLATE,
    image_row,
    make_text_checkpoint,
    with_hub_template,
    write_chat,
)
from tests.train_runs import ROOT, run_module, run_train

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def text_base(tmp_path_factory) -> Path:
    return make_text_checkpoint(tmp_path_factory.mktemp("qwen2-text"))


def _config(spec: str):
    from valen_jax.cli.boundary import load_config_file
    path, _, variant = spec.partition(":")
    return load_config_file(f"{ROOT / path}:{variant}")


def _fingerprint(tokenizer: str, family: str = "chatml") -> dict:
    from data_pipeline.tokenizer import load_tokenizer
    from valen_jax.training import checkpoint
    return checkpoint.fingerprint_of(load_tokenizer(tokenizer, family))


@pytest.mark.parametrize("spec, which, data, fmt", [
    ("configs/chat.py:hf,lora", "train", "own", "chat"),
    ("configs/vflash.py:hf,lora", "eval", str(ROOT / "data/smoke/vflash/eval.jsonl"), "vflash")])
def test_every_conversion_of_a_run_installs_the_template_family(text_base, tmp_path, spec, which, data, fmt):
    """Failure 1: a hub template (no {% generation %} markers) converts with config.data.template_family."""
    from valen_jax.data.shard_cache import SETS, config_shards

    config = _config(spec)
    config.data.tokenizer = str(text_base)
    source_key, format_key, _ = SETS[which]
    config.data[source_key] = str(write_chat(tmp_path / "own.jsonl", OWN_TRAIN)) if data == "own" else data
    config.data[format_key] = fmt
    shard_set = config_shards(config, which, tmp_path / "cache", _fingerprint(str(text_base)))
    manifest = shard_set.manifest.data
    assert manifest["options"]["template_family"] == "chatml" and manifest["counts"]["supervised_tokens"] > 0


def test_a_qwen2_5_vl_tokenizer_with_its_hub_template_converts_vflash_records(vl_checkpoint, tmp_path):
    """Failure 1 with configs/vflash.py:hf,lora on a Qwen2.5-VL checkpoint: its recipe converts too."""
    from valen_jax.data.shard_cache import config_shards

    directory, _ = vl_checkpoint("qwen2_5_vl")
    tokenizer = with_hub_template(directory, tmp_path / "tokenizer", QWEN2_5_VL_TEMPLATE)
    config = _config("configs/vflash.py:hf,lora")
    config.data.tokenizer = str(tokenizer)
    shard_set = config_shards(config, "train", tmp_path / "cache", _fingerprint(str(tokenizer)))
    manifest = shard_set.manifest.data
    assert manifest["format"] == "recipe" and manifest["options"]["template_family"] == "chatml"
    assert manifest["counts"]["supervised_tokens"] > 0


@pytest.mark.parametrize("which", ["train", "eval"])
def test_a_jsonl_where_a_recipe_is_configured_names_the_key_and_the_format_that_reads_it(tmp_path, which):
    """Failure 5 (format mistakes): configs/vflash.py reads data.format and data.eval_format as recipes."""
    from valen_jax.data.shard_cache import config_shards
    from valen_jax.errors import ConfigError

    config = _config("configs/vflash.py")
    own = tmp_path / "own.jsonl"
    shutil.copy(ROOT / "data/smoke/vflash/eval.jsonl", own)
    key, format_key = ("train", "format") if which == "train" else ("eval", "eval_format")
    config.data[key] = str(own)
    assert config.data[format_key] == "recipe"
    with pytest.raises(ConfigError) as refused:
        config_shards(config, which, tmp_path / "cache", _fingerprint(str(ROOT / "data/tokenizer")))
    assert str(refused.value) == (
        f"config.data.{format_key}='recipe' cannot read config.data.{key}={str(own)!r} ({own}:2: recipe: invalid "
        f"JSON: Extra data at column 1); it reads as vflash: set --config.data.{format_key}=vflash")
    # A file no format reads keeps its own problems, PATH:LINE each.
    own.write_text("{not json\n")
    from data_pipeline.formats.errors import FormatError
    with pytest.raises(FormatError, match=r"recipe: invalid JSON"):
        config_shards(config, which, tmp_path / "cache", _fingerprint(str(ROOT / "data/tokenizer")))


def test_a_text_checkpoint_gets_no_vision_tower_and_refuses_vision_keys(text_base):
    """Failure 2 at its cause: configs/chat.py:hf used to bolt a fresh tower onto a text checkpoint."""
    from data_pipeline.tokenizer import load_tokenizer
    from valen_jax.errors import ConfigError
    from valen_jax.models import build

    config = _config("configs/chat.py:hf,lora")
    config.model.init_from = str(text_base)
    tokenizer = load_tokenizer(str(text_base), "chatml")
    assert build.model_config(config, tokenizer).vision is None
    config.model.vision.dim = 32
    with pytest.raises(ConfigError, match=r"is a qwen2 text checkpoint, which gets no vision tower, so "
                                          r"config.model.vision.\{dim\} would be ignored"):
        build.model_config(config, tokenizer)


def _own_images(tmp_path: Path) -> Path:
    (tmp_path / "images").mkdir()
    shutil.copy(ROOT / "data/smoke/chat/images/shape_003.png", tmp_path / "images/shape.png")
    return write_chat(tmp_path / "own_images.jsonl", [OWN_TRAIN[1], image_row("images/shape.png"), OWN_TRAIN[2]])


def _refusal(result) -> str:
    assert result.returncode == 1, result.stderr[-3000:]
    return result.stderr.strip().splitlines()[-1]


def test_image_rows_on_a_text_base_are_refused_before_any_device_naming_the_row(text_base, tmp_path):
    """Seed 003: the base model must accept images. Refused in the preflight: the workdir is never made."""
    own = _own_images(tmp_path)
    workdir = tmp_path / "run"
    line = _refusal(run_train("configs/chat.py:hf,lora", workdir, f"--config.model.init_from={text_base}",
                              f"--config.data.tokenizer={text_base}", f"--config.data.train={own}",
                              "--config.data.eval=None", check=False, timeout=180))
    assert line == (f"ConfigError: {own}:2: messages[0].content[1]: an image in config.data.train, but "
                    f"config.model.init_from={str(text_base)!r} is a text checkpoint; the base model must accept "
                    "images to train on them (seed 003): start from a vision-language checkpoint (Qwen2-VL, "
                    "Qwen2.5-VL, Qwen3-VL) or leave image rows out"), line
    assert not workdir.exists()


def test_model_vision_none_from_the_command_line_makes_a_text_model(tmp_path):
    """`--config.model.vision=None` (refused by ml_collections' parser before) unsets the tower of a
    from-scratch run: its image rows are then refused naming that key."""
    own = _own_images(tmp_path)
    workdir = tmp_path / "run"
    line = _refusal(run_train("configs/chat.py:tiny", workdir, "--config.model.vision=None",
                              f"--config.data.train={own}", "--config.data.eval=None", check=False, timeout=180))
    assert line.startswith(f"ConfigError: {own}:2: messages[0].content[1]: an image in config.data.train, but "
                           "config.model.vision=None (a text model); "), line
    assert not workdir.exists()


def test_own_training_data_beside_the_bundled_eval_set_is_refused(tmp_path):
    """Failure 5 (no silent default eval set): the smoke eval set would score a model trained on other data."""
    own = write_chat(tmp_path / "own.jsonl", OWN_TRAIN)
    workdir = tmp_path / "run"
    line = _refusal(run_train("configs/chat.py:tiny", workdir, f"--config.data.train={own}", check=False,
                              timeout=180))
    assert line == (f"ConfigError: config.data.train={str(own)!r} is your own data, but config.data.eval is still "
                    f"the bundled smoke set {str(ROOT / 'data/smoke/chat/eval.jsonl')!r}: set "
                    "--config.data.eval=PATH to your held-out file (read as config.data.eval_format='chat'), or "
                    "--config.data.eval=None to train without evaluation (or --config.eval.at_end=False with "
                    "--config.eval.every=0)"), line
    assert not workdir.exists()


@pytest.mark.slow
def test_a_hub_text_checkpoint_trains_on_own_chat_files_evaluates_them_and_exports(text_base, tmp_path):
    """The four keys, no pre-conversion: train → the report and the log name the own eval file → export
    merged and --adapter (refused before: the fresh tower bolted onto the text checkpoint)."""
    train = write_chat(tmp_path / "own_train.jsonl", OWN_TRAIN)
    held_out = write_chat(tmp_path / "own_eval.jsonl", OWN_EVAL)
    workdir = tmp_path / "run"
    result = run_train("configs/chat.py:hf,lora", workdir, f"--config.model.init_from={text_base}",
                       f"--config.data.tokenizer={text_base}", f"--config.data.train={train}",
                       f"--config.data.eval={held_out}", "--config.train.steps=2", "--config.train.log_every=1",
                       "--config.train.checkpoint_every=2", "--config.train.warmup_steps=1",
                       "--config.model.dtype=float32", "--config.data.global_batch=4", "--config.data.seq_len=512",
                       "--config.eval.every=0", "--config.eval.max_examples=2", "--config.eval.max_new_tokens=4",
                       "--config.model.lora.rank=4", timeout=600)
    report = json.loads((workdir / "eval/report-2.json").read_text())
    assert report["data"] == str(held_out) and report["examples"] == 2
    last = [line for line in result.stderr.splitlines() if "evaluated:" in line]
    assert last and f"evaluated: config.data.eval={held_out} (config.data.eval_format=chat) at step 2" in last[-1]
    meta = json.loads((workdir / "checkpoints/2/meta/metadata").read_text())
    assert meta["model"]["vision"] is None
    for flags in ((), ("--adapter",)):
        output = tmp_path / f"export{'-'.join(flags)}"
        run_module("valen_jax.export", f"--workdir={workdir}", f"--output={output}", *flags, timeout=300)
        assert (output / ("adapter_config.json" if flags else "config.json")).is_file()

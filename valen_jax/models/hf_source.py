"""What an export writes back of the Hugging Face checkpoint a run started from: its config.json fields, its
generation_config.json and its own chat template(s).

A user's serving stack (transformers' `generate`, vLLM) reads more of a checkpoint than the weights: the
special token ids (`bos_token_id`...), `max_position_embeddings`, rope scaling, the generation defaults
(eos ids, sampling) and the chat template it formats requests with. Our model config holds none of them,
so `train` keeps the source's files in `WORKDIR/source/` at start-up (`keep`; the source may be gone or
changed by export time), and `export` writes config.json as the source's with only what the run changed
(`exported_config`), its generation_config.json as it was (`exported_generation_config`), and the
tokenizer with the checkpoint's own template as the default and the training template beside it under
`TRAINING_TEMPLATE` (`write_templates`: transformers' `additional_chat_templates/`).

A leaf beside `hf_common`: files and dicts only, no model.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

from valen_jax.models.hf_common import resolve

CONFIG, GENERATION_CONFIG = "config.json", "generation_config.json"
# transformers' names (utils/hub.py: CHAT_TEMPLATE_FILE, CHAT_TEMPLATE_DIR): the default template, and the
# named ones `apply_chat_template(..., chat_template=NAME)` picks.
TEMPLATE_FILE, TEMPLATE_DIR = "chat_template.jinja", "additional_chat_templates"
# The name the training template (with {% generation %} markers) keeps in an export.
TRAINING_TEMPLATE = "training"
# What config.json says that our ModelConfig does not determine: the source's value is kept, ours is a placeholder.
_PLACEHOLDERS = ("max_position_embeddings",)
# Token ids transformers reads for generation and padding: the source's win; the tokenizer's fill the gaps.
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def keep(folder: str | Path, init_from: str, templates: str | dict | None) -> Path:
    """Write into `folder` the source checkpoint's config.json and generation_config.json (those it has;
    `init_from`: a directory or hub name, "" for a model trained from scratch) and `templates`, the chat
    template(s) the training template replaced (`data_pipeline.tokenizer.checkpoint_chat_template`)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if init_from:
        directory = resolve(init_from)
        for name in (CONFIG, GENERATION_CONFIG):
            if (directory / name).is_file():
                shutil.copyfile(directory / name, folder / name)
    if templates:
        write_template_files(folder, templates)
    return folder


def read_json(folder: Path | None, name: str) -> dict | None:
    path = folder / name if folder is not None else None
    return json.loads(path.read_text()) if path is not None and path.is_file() else None


def write_template_files(folder: Path, templates: str | dict) -> None:
    """`templates` (one text, or a dict of named ones with "default" the default) as transformers saves them."""
    named = {"default": templates} if isinstance(templates, str) else dict(templates)
    for name, text in named.items():
        if name == "default":
            (folder / TEMPLATE_FILE).write_text(text)
        else:
            (folder / TEMPLATE_DIR).mkdir(exist_ok=True)
            (folder / TEMPLATE_DIR / f"{Path(name).name}.jinja").write_text(text)


def read_template_files(folder: Path | None) -> str | dict | None:
    """The template(s) `write_template_files` wrote into `folder`: a text, a dict of named ones, or None."""
    if folder is None:
        return None
    named = {path.stem: path.read_text() for path in sorted((folder / TEMPLATE_DIR).glob("*.jinja"))}
    if (folder / TEMPLATE_FILE).is_file():
        named["default"] = (folder / TEMPLATE_FILE).read_text()
    if list(named) == ["default"]:
        return named["default"]
    return named or None


def write_templates(tokenizer_folder: Path, training: str, checkpoint: str | dict | None) -> None:
    """Rewrite the chat templates of a saved tokenizer: the checkpoint's own as the default (what HF and vLLM
    format requests with), the training template named TRAINING_TEMPLATE beside it. With no template of
    the checkpoint's (it had none, or its own had generation markers and trained as it was), the training
    template stays the only one."""
    config_path = tokenizer_folder / "tokenizer_config.json"
    if config_path.is_file():  # a legacy tokenizer_config.json entry would shadow the template files
        config = json.loads(config_path.read_text())
        if config.pop("chat_template", None) is not None:
            config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (tokenizer_folder / TEMPLATE_FILE).unlink(missing_ok=True)
    shutil.rmtree(tokenizer_folder / TEMPLATE_DIR, ignore_errors=True)
    if not checkpoint:
        write_template_files(tokenizer_folder, training)
        return
    named = {"default": checkpoint} if isinstance(checkpoint, str) else dict(checkpoint)
    if TRAINING_TEMPLATE in named:
        raise ValueError(f"the checkpoint has a chat template named {TRAINING_TEMPLATE!r} already")
    write_template_files(tokenizer_folder, {**named, TRAINING_TEMPLATE: training})


def _merged(source: dict, ours: dict, placeholders: tuple[str, ...]) -> dict:
    merged = copy.deepcopy(source)
    for key, value in ours.items():
        if key in placeholders and key in source:
            continue
        if isinstance(value, dict) and isinstance(source.get(key), dict):
            merged[key] = _merged(source[key], value, placeholders)
        else:
            merged[key] = value
    return merged


def exported_config(ours: dict, source: dict | None, token_ids: dict[str, int]) -> dict:
    """config.json of an export: the source checkpoint's, every field kept but those our model states
    (architecture, vocab_size grown by added tokens, the weights' dtype; `max_position_embeddings` is
    the source's), nested configs (`text_config`, `vision_config`) merged key by key; then `token_ids`
    (the tokenizer's bos/eos/pad ids, and a VLM's vision ids) where the source states none. Without a
    source (a model trained from scratch): ours with `token_ids`."""
    source = source or {}
    config = _merged(source, ours, _PLACEHOLDERS)
    if "text_config" in ours and "text_config" not in source:
        # A VLM's config in the older flat form (Qwen2-VL, Qwen2.5-VL on the hub) states the decoder's keys at
        # the top: those we state are ours there too (a stale vocab_size would contradict text_config's), and
        # its max_position_embeddings is the decoder's.
        for key, value in ours["text_config"].items():
            if key in source and key != "model_type":
                config[key] = source[key] if key in _PLACEHOLDERS else value
        for key in _PLACEHOLDERS:
            if key in source:
                config["text_config"][key] = source[key]
    if "torch_dtype" in config:  # transformers 4's name of `dtype`: both name the dtype of the weights written
        config["torch_dtype"] = ours["dtype"]
    for key, value in token_ids.items():
        vision = key.startswith("vision_")
        config[key] = value if vision or config.get(key) is None else config[key]
        if "text_config" in config and not vision and config["text_config"].get(key) is None:
            config["text_config"][key] = config[key]  # the decoder's own config reads them there
    return config


def exported_generation_config(config: dict, source: dict | None) -> dict:
    """generation_config.json of an export: the source's as it was (eos ids, sampling defaults); from the
    exported config's token ids when the source had none (transformers' `from_model_config` does the same)."""
    if source is not None:
        return source
    text = config.get("text_config", {})
    ids = {key: config.get(key, text.get(key)) for key in TOKEN_IDS}
    return {"_from_model_config": True, **{key: value for key, value in ids.items() if value is not None}}

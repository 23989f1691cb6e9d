"""A run's data against its config, before any device is claimed (issue 54): what every mode refuses.

    from valen_jax.training.preflight import check_run_data
    check_run_data(config)   # ConfigError naming the key to set, or PATH:LINE of the row

Two rules, each one line through the commands' error boundary:

- **No silent default eval set.** `config.data.eval` is what the run evaluates, during training
  (`eval.every`) and at its end (`eval.at_end`); `--config.data.eval=None` trains without evaluating.
  The bundled smoke eval sets (`data/smoke/` of the checkout, the configs' defaults) are evaluated
  only beside bundled training data: a run on the user's own `data.train` that would evaluate a
  bundled `data.eval` is refused, naming `config.data.eval`, since its report would score the model on
  data that has nothing to do with the user's. (A run that evaluates nothing, `eval.at_end=False` and
  `eval.every=0`, only checks the bundled set's separation from the training data.)
- **Images need a base that accepts them** (seed 003: "Training on images uses a vision model's
  processor and adapts its language backbone. The base model must therefore accept images."). A text
  checkpoint in `config.model.init_from` gets no vision tower, nor does a model trained from scratch
  with `config.model.vision=None`: a row holding an image is refused, naming its PATH:LINE, its field
  and the config key. Shard directories are refused by their manifest's media list.

Both read only the config and the raw data (and the checkpoint's config.json); nothing touches JAX.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from data_pipeline import format_registry
from data_pipeline.formats.chat import ChatRecord, ImagePart
from data_pipeline.formats.errors import FormatError
from data_pipeline.formats.vflash import VFlashRecord
from valen_jax.errors import ConfigError
from valen_jax.models import build, hf_vl

# The smoke data the configs ship (configs/common.py puts data.train/data.eval there by default).
BUNDLED_DATA = Path(__file__).resolve().parents[2] / "data" / "smoke"
# Formats whose records can hold images (vakforge holds audio, prepared rows token ids).
_IMAGE_FORMATS = ("chat", "vflash", "recipe", "valen")


def check_run_data(config) -> None:
    """The refusals of the module docstring, eval data first."""
    check_eval_data(config)
    check_images_fit_model(config)


def _paths(value) -> list[str]:
    """The paths a data key names: one path, or a mixture's (path, weight) pairs."""
    if isinstance(value, (list, tuple)):
        return [str(item[0] if isinstance(item, (list, tuple)) else item) for item in value]
    return [str(value)]


def is_bundled(value) -> bool:
    """Whether every path of a data key lies in the checkout's bundled smoke data."""
    paths = _paths(value)
    return bool(paths) and all(BUNDLED_DATA == Path(p).resolve() or BUNDLED_DATA in Path(p).resolve().parents
                               for p in paths)


def check_eval_data(config) -> None:
    """Own training data with a bundled eval set is refused (see the module docstring)."""
    data = config.data
    if data.eval is None or not is_bundled(data.eval) or is_bundled(data.train) or not _evaluates(config):
        return
    raise ConfigError(f"config.data.train={_shown(data.train)} is your own data, but config.data.eval is still the "
                      f"bundled smoke set {_shown(data.eval)}: set --config.data.eval=PATH to your held-out file "
                      f"(read as config.data.eval_format={data.eval_format!r}), or --config.data.eval=None to "
                      "train without evaluation (or --config.eval.at_end=False with --config.eval.every=0)")


def _evaluates(config) -> bool:
    """Whether the run evaluates data.eval: at its end, or every eval.every steps within train.steps."""
    every = int(config.eval.every)
    return bool(config.eval.at_end) or 0 < every <= int(config.train.steps)


def _shown(value) -> str:
    paths = _paths(value)
    return repr(paths[0]) if len(paths) == 1 else repr(paths)


def check_images_fit_model(config) -> None:
    """A model without a vision tower refuses image rows (see the module docstring)."""
    takes_images, why = _accepts_images(config)
    if takes_images:
        return
    data = config.data
    sets = [("train", data.train, data.format, data.train_options)]
    if data.eval is not None:
        sets.append(("eval", data.eval, data.eval_format, data.eval_options))
    for which, value, fmt, options in sets:
        for path in _paths(value):
            found = _first_image(Path(path), fmt, options.to_dict())
            if found is not None:
                raise ConfigError(f"{found}: an image in config.data.{which}, but {why}; the base model must "
                                  "accept images to train on them (seed 003): start from a vision-language "
                                  "checkpoint (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) or leave image rows out")


def _accepts_images(config) -> tuple[bool, str]:
    """(whether the run's model has a vision tower, why not in the words of its config key)."""
    if config.train.mode == "vflash":
        return True, ""  # the drafter's target (model.target_from) is checked when it is restored
    rl = config.get("rl")
    if rl is not None and rl.get("from_workdir"):
        return True, ""  # the starting workdir's model, as it was trained
    if config.model.init_from:
        if hf_vl.is_vl(build.checkpoint_config(str(config.model.init_from))):
            return True, ""
        return False, f"config.model.init_from={str(config.model.init_from)!r} is a text checkpoint"
    if config.model.vision is None:
        return False, "config.model.vision=None (a text model)"
    return True, ""


def _first_image(path: Path, fmt: str, options: dict) -> str | None:
    """`PATH:LINE: FIELD` of the first row of `path` that holds an image, or of a shard directory's first
    media file; None when there is none. Data the format cannot read passes: conversion reports it."""
    if path.is_dir():
        manifest = path / "manifest.json"
        try:
            media = json.loads(manifest.read_text()).get("media", []) if manifest.is_file() else []
        except (OSError, ValueError):
            return None
        return f"{path}: shards holding {len(media)} media files (first: {media[0]['name']})" if media else None
    if fmt not in _IMAGE_FORMATS or not path.is_file():
        return None
    spec = format_registry.get(fmt)
    try:
        entries = spec.load(path, **{key: options.get(key, default) for key, default in spec.load_options.items()})
    except (FormatError, OSError, ValueError):  # unreadable data: conversion reports it, PATH:LINE each
        return None
    for entry in entries:
        for record in entry.records:
            for field in _image_fields(record):
                return f"{record.source}:{record.line}: {field}"
    return None


def _image_fields(record) -> Iterator[str]:
    if isinstance(record, ChatRecord):
        for i, message in enumerate(record.messages):
            if isinstance(message.content, tuple):
                for j, part in enumerate(message.content):
                    if isinstance(part, ImagePart):
                        yield f"messages[{i}].content[{j}]"
        return
    if getattr(record, "media", ()):  # VFlash and Valen records list their media
        yield "image" if isinstance(record, VFlashRecord) else "media"

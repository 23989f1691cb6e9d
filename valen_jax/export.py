"""Export a trained workdir as a Hugging Face checkpoint: weights, tokenizer and processor settings.

    python -m valen_jax.export --workdir=runs/vflash-smoke-hf --output=/tmp/exported [--step=N]
    python -m valen_jax.export --workdir=runs/lora --output=/tmp/adapter --adapter   # a LoRA run: PEFT folder
    python -c "import transformers; transformers.AutoModelForImageTextToText.from_pretrained('/tmp/exported')"

The parameters are restored as `evaluate` restores them (verified against their save-time digests;
the latest step unless `--step`) and written by `hf.save_pretrained`: a Qwen2-VL / Qwen2.5-VL /
Qwen3-VL model (one trained from such a checkpoint) as its family's checkpoint, vision tower
included; a text-only model as Qwen2, Qwen3 or Llama. Next to them: the training tokenizer the
workdir saved (primitive tokens included), and, for a VLM,
`preprocessor_config.json` / `video_preprocessor_config.json` stating the run's `media_kwargs`
(pixel bounds, mean/std, patch/merge/temporal sizes, fps and frame bounds), so the directory is a
complete checkpoint: transformers loads it, and `config.model.init_from` starts another run from it
with the same processor settings.

What a serving stack reads of the checkpoint the run started from is written back (`models/hf_source.py`,
from the copy `train` kept in `WORKDIR/source/`): config.json is the source's with only what the run
changed (the architecture it states, `vocab_size` grown by added tokens, the weights' dtype), so
`bos_token_id`/`eos_token_id`/`pad_token_id`, `max_position_embeddings`, rope scaling and the rest stay;
`generation_config.json` is the source's (written from the token ids when it had none); the tokenizer's
default chat template is the checkpoint's own (what transformers' `apply_chat_template` and vLLM format
requests with), and the training template (with `{% generation %}` markers) sits beside it as the named
template "training" (`additional_chat_templates/training.jinja`; `apply_chat_template(...,
chat_template="training")`).

A LoRA workdir (`config.model.lora`) exports merged by default (`--merge`: W + (alpha/r)·A·B, an NF4 base
dequantised: a plain checkpoint of the base's family), or with `--adapter` as a PEFT adapter folder
(`adapter_config.json`, `adapter_model.safetensors`, `models/peft_adapter.py`, and the tokenizer) whose
`base_model_name_or_path` is the run's `config.model.init_from`. The embedding rows the run holds that the
base resized by transformers does not (the added tokens' rows: VFlash's `<0>`…`<1000>` and tags, and any
trained row) travel in it as PEFT's `trainable_token_indices`, so it gives the merged export's logits when
loaded as transformers resizes a base for a grown tokenizer:

    tokenizer = transformers.AutoTokenizer.from_pretrained("/tmp/adapter")
    model = transformers.AutoModelForCausalLM.from_pretrained(BASE)   # AutoModelForImageTextToText for a VLM
    model.resize_token_embeddings(len(tokenizer))
    model = peft.PeftModel.from_pretrained(model, "/tmp/adapter")

Refused, naming why: a model whose vision tower is our own from-scratch ViT (family "valen": no
Hugging Face class holds it; exporting its decoder alone would drop what it learned from images).
Dropped with a logged line: Valen's scalar score head (no transformers class has one).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from data_pipeline import vocabulary
from data_pipeline.tokenizer import from_pretrained as load_hf_tokenizer
from data_pipeline.tokenizer import has_generation_markers, token_id
from valen_jax.cli import log_setup as cli_logging
from valen_jax.cli.boundary import error_boundary
from valen_jax.data.vision_processor import (
    IMAGE_PROCESSOR_FILE,
    RESCALE_FACTOR,
    VIDEO_PIXELS_PER,
    VIDEO_PROCESSOR_FILE,
)
from valen_jax.errors import UserError
from valen_jax.models import hf, hf_source, hf_vl, peft_adapter
from valen_jax.models.config import ModelConfig
from valen_jax.run import restore_model
from valen_jax.training import checkpoint

log = logging.getLogger("valen_jax.export")

_PROCESSOR_CLASS = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen3_vl": "Qwen3VLProcessor"}
_VIDEO_PROCESSOR = {"qwen2_vl": "Qwen2VLVideoProcessor", "qwen2_5_vl": "Qwen2VLVideoProcessor",
                    "qwen3_vl": "Qwen3VLVideoProcessor"}
# What our processor always does (vision_processor.FIXED_SETTINGS), stated so no reader assumes otherwise.
_FIXED = {"do_resize": True, "do_rescale": True, "rescale_factor": RESCALE_FACTOR, "do_normalize": True,
          "do_convert_rgb": True, "resample": 3}


class ExportError(UserError, ValueError):
    """A workdir whose model has no Hugging Face form."""


def exportable(model_cfg: ModelConfig) -> None:
    """Refuse, by name, a model no transformers class reproduces."""
    vision = model_cfg.vision
    if vision is not None and vision.family not in hf_vl.VL_FAMILIES:
        raise ExportError(f"the model's vision tower is family {vision.family!r} (our own ViT, trained from scratch "
                          "or added fresh to a text checkpoint): no Hugging Face class holds it, and exporting the "
                          "decoder alone would drop what the model learned from images. Only models trained from a "
                          f"{', '.join(hf_vl.VL_FAMILIES)} checkpoint (or text-only models) export")
    if vision is None and model_cfg.mrope_section is not None:
        raise ExportError("an M-RoPE decoder without its vision tower has no Hugging Face family")


def processor_files(model_cfg: ModelConfig, media_kwargs: dict) -> dict[str, dict]:
    """preprocessor_config.json and video_preprocessor_config.json stating the run's media_kwargs, as the
    family's processor files spell them (size.shortest_edge / longest_edge are pixel areas)."""
    vision = model_cfg.vision
    family = vision.family
    geometry = {"patch_size": vision.patch_size, "merge_size": vision.merge_size,
                "temporal_patch_size": vision.temporal_patch_size}
    colour = {"image_mean": list(media_kwargs["image_mean"]), "image_std": list(media_kwargs["image_std"])}
    # The reader (vision_processor.processor_media_kwargs) takes video_pixels_per from the video processor's
    # type: the type that states the run's own setting, even where it is not the family's usual one.
    by_setting = {setting: kind for kind, setting in VIDEO_PIXELS_PER.items()}
    video_type = by_setting[media_kwargs["video_pixels_per"]]
    if video_type != _VIDEO_PROCESSOR[family]:
        log.warning("the run bounded video pixels per %s, which %s states; %s's own video processor is %s",
                    media_kwargs["video_pixels_per"], video_type, family, _VIDEO_PROCESSOR[family])
    image = {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": _PROCESSOR_CLASS[family], **_FIXED,
             **colour, "size": {"shortest_edge": int(media_kwargs["min_pixels"]),
                                "longest_edge": int(media_kwargs["max_pixels"])}, **geometry}
    video = {"video_processor_type": video_type, "processor_class": _PROCESSOR_CLASS[family], **_FIXED, **colour,
             "size": {"shortest_edge": int(media_kwargs["video_min_pixels"]),
                      "longest_edge": int(media_kwargs["video_max_pixels"])},
             "do_sample_frames": True, "fps": float(media_kwargs["fps"]), "min_frames": int(media_kwargs["min_frames"]),
             "max_frames": int(media_kwargs["max_frames"]), **geometry}
    return {IMAGE_PROCESSOR_FILE: image, VIDEO_PROCESSOR_FILE: video}


def special_token_ids(tokenizer, model_cfg: ModelConfig) -> dict[str, int]:
    """The ids transformers reads from config.json for generation and media: without them it falls back to
    the Qwen hub ids (151643...), outside the vocabulary of any other tokenizer."""
    ids = {key: getattr(tokenizer, key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")
           if getattr(tokenizer, key) is not None}
    if model_cfg.vision is not None:
        ids["vision_start_token_id"] = token_id(tokenizer, vocabulary.VISION_START)
        ids["vision_end_token_id"] = token_id(tokenizer, vocabulary.VISION_END)
    return {key: int(value) for key, value in ids.items()}


def _source(restored) -> tuple[Path | None, str | dict | None]:
    """(the folder holding the source checkpoint's config.json / generation_config.json, the chat template(s)
    the training template replaced): the copy `train` kept in WORKDIR/source, or for a workdir trained
    before it kept one, the source itself where it still is (`config.model.init_from`,
    `config.data.tokenizer`), named in the log."""
    kept = checkpoint.source_dir(restored.workdir)
    if kept.is_dir():
        return kept, hf_source.read_template_files(kept)
    init_from, tokenizer = str(restored.config.model.init_from or ""), str(restored.config.data.tokenizer)
    log.warning("%s has no source/ (trained before train kept the source checkpoint's files): reading "
                "config.model.init_from=%r and config.data.tokenizer=%r as they are now", restored.workdir,
                init_from, tokenizer)
    folder = None
    if init_from:
        try:
            folder = hf.resolve(init_from)
        except (OSError, hf.HFImportError) as error:
            log.warning("config.model.init_from=%r: %s; config.json states only what the model does", init_from,
                        error)
    try:
        template = load_hf_tokenizer(tokenizer).chat_template
    except (OSError, ValueError) as error:
        log.warning("config.data.tokenizer=%r: %s; the export's chat template is the training one", tokenizer, error)
        template = None
    return folder, None if has_generation_markers(template) else template


def _write_tokenizer(restored, output: Path, templates: str | dict | None) -> None:
    """The tokenizer exactly as the run used it (restore checked its fingerprint against the checkpoint's),
    with the checkpoint's own chat template as the default and the training one named beside it."""
    shutil.copytree(checkpoint.tokenizer_dir(restored.workdir), output, dirs_exist_ok=True)
    hf_source.write_templates(output, restored.tokenizer.chat_template, templates)


def export(workdir: str | Path, output: str | Path, step: int | None = None, adapter: bool = False) -> Path:
    """Write the workdir's checkpoint at `step` (default: the latest) to `output` as an HF checkpoint (merged,
    for a LoRA run), or with `adapter` a LoRA run's adapters as a PEFT folder."""
    workdir, output = Path(workdir), Path(output)
    restored = restore_model(workdir, step)
    model_cfg = restored.model_cfg
    exportable(model_cfg)
    if adapter:
        return _export_adapter(restored, output)
    mgr = checkpoint.manager(restored.workdir, read_only=True)
    try:
        meta = checkpoint.restore_meta(mgr, restored.step)
    finally:
        mgr.close()
    if model_cfg.score_head:
        log.warning("the Valen score head (score_head/*) is not exported: no transformers class has one; the "
                    "exported model gives the decoder's token logits only")
    model = nnx.merge(restored.graphdef, restored.params)
    hf.save_pretrained(model, output)
    source, templates = _source(restored)
    config = hf_source.exported_config(json.loads((output / hf_source.CONFIG).read_text()),
                                       hf_source.read_json(source, hf_source.CONFIG),
                                       special_token_ids(restored.tokenizer, model_cfg))
    generation = hf_source.exported_generation_config(config, hf_source.read_json(source, hf_source.GENERATION_CONFIG))
    for name, content in ((hf_source.CONFIG, config), (hf_source.GENERATION_CONFIG, generation)):
        (output / name).write_text(json.dumps(content, indent=2) + "\n")
    _write_tokenizer(restored, output, templates)
    if model_cfg.vision is not None:
        for name, settings in processor_files(model_cfg, meta["media_kwargs"]).items():
            (output / name).write_text(json.dumps(settings, indent=2) + "\n")
    kind = model_cfg.vision.family if model_cfg.vision is not None else "text"
    log.info("exported step %d of %s (%s, vocabulary %d) to %s", restored.step, restored.workdir, kind,
             model_cfg.vocab_size, output)
    return output


def _export_adapter(restored, output: Path) -> Path:
    cfg = restored.model_cfg
    if cfg.lora is None:
        raise ExportError(f"--adapter: {restored.workdir} trained every parameter (config.model.lora unset); "
                          "export it without --adapter")
    if cfg.lora.quantize_base != "none":
        raise ExportError(f"--adapter: {restored.workdir} trained on an NF4 base (QLoRA); its adapters fit that "
                          "base, not the float one PEFT would load them on: export it merged (--merge)")
    params = jax.tree.map(lambda x: np.asarray(jax.device_get(x)), restored.params)
    base = str(restored.config.model.init_from or "")
    tokens = peft_adapter.save_adapter(cfg, params, output, base=base, vocabulary=len(restored.tokenizer))
    _write_tokenizer(restored, output, _source(restored)[1])
    log.info("exported the LoRA adapters (rank %d, %s) and %d embedding rows of step %d of %s to %s (base: %s)",
             cfg.lora.rank, ", ".join(cfg.lora.targets), tokens, restored.step, restored.workdir, output,
             base or "fresh")
    return output


def build_parser() -> argparse.ArgumentParser:
    """The command line of `main` (one-word flags only; a multi-word one goes through `cli_flags.add_flag`)."""
    parser = argparse.ArgumentParser(prog="python -m valen_jax.export", description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True, help="a workdir written by valen_jax.train")
    parser.add_argument("--output", "--out", required=True, help="the directory to write the HF checkpoint into")
    parser.add_argument("--step", type=int, default=None, help="the checkpoint step (default: the latest)")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--merge", action="store_true", help="a LoRA run: its merged weights (the default)")
    what.add_argument("--adapter", action="store_true", help="a LoRA run: its adapters as a PEFT folder")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # force: an import may already have configured the root logger at WARNING, hiding what was written where.
    cli_logging.configure(force=True)
    with error_boundary("valen_jax.export", paths=(args.workdir, args.output)):
        export(args.workdir, args.output, args.step, adapter=args.adapter)
    return 0


if __name__ == "__main__":
    sys.exit(main())

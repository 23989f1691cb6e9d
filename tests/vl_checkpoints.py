"""Tiny random Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoints shaped like the ones users download.

`make_vl_checkpoint(directory, family)` writes, with transformers and no hub: a fast BPE tokenizer
trained on the smoke texts that holds ChatML's control tokens and Qwen's vision tokens as special
tokens (as real Qwen tokenizers do, so a training run must not add them again), the model
(`save_pretrained`; decoder 64 wide with 2 layers, a 2-block vision tower with 8-pixel patches), and the
image/video processor files real Qwen checkpoints ship, sized so a 128 × 128 smoke image is 64 patches
(16 vision tokens). One-dimensional weights (norms, biases) are moved off their initial one/zero, as in
tests/test_hf_vl_parity.py, so an importer that drops one of them fails a parameter comparison.

Tests that need a checkpoint more than once share it through the session fixture `vl_checkpoint`
(import it into the test module: `from tests.vl_checkpoints import vl_checkpoint  # noqa: F401`):
`vl_checkpoint("qwen2_5_vl")` → (directory, info), built once per (family, seed) per session.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.once_per_run import build_once

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
PATCH, MERGE, TEMPORAL = 8, 2, 2
# The smoke images are 128 × 128: with max_pixels 64² they resize to 64 × 64, 8 × 8 = 64 patches, 16 tokens.
MIN_PIXELS, MAX_PIXELS = 32 * 32, 64 * 64
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", *VISION_TOKENS)
# The three towers as their transformers configs spell them (the key names differ by family).
_VISION = {
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration",
                 dict(depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2)),
    # Window of 32 pixels = 2 × 2 merged cells: a 64 × 64 image has 4 windows; block 1 attends fully.
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration",
                   dict(depth=2, hidden_size=32, intermediate_size=48, out_hidden_size=64, window_size=32,
                        fullatt_block_indexes=[1], tokens_per_second=2)),
    # An 8 × 8 position table resampled to each grid; deepstack features of vision block 0 join decoder layer 0.
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration",
                 dict(depth=2, hidden_size=32, intermediate_size=48, out_hidden_size=64, num_position_embeddings=64,
                      deepstack_visual_indexes=[0])),
}
# What the real checkpoints' processor files say, except the pixel bounds and patch geometry.
_CLIP_MEAN, _CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
_PROCESSOR = {
    "qwen2_vl": ("Qwen2VLImageProcessor", "Qwen2VLVideoProcessor", _CLIP_MEAN, _CLIP_STD),
    "qwen2_5_vl": ("Qwen2VLImageProcessor", "Qwen2VLVideoProcessor", _CLIP_MEAN, _CLIP_STD),
    "qwen3_vl": ("Qwen2VLImageProcessorFast", "Qwen3VLVideoProcessor", [0.5, 0.5, 0.5], [0.5, 0.5, 0.5]),
}


def _tokenizer(directory: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AddedToken, PreTrainedTokenizerFast

    from data_pipeline.chat_templates import CHATML

    texts = [json.loads(line)["conversations"][0]["value"]
             for line in (ROOT / "data/smoke/vflash/points.jsonl").read_text().splitlines()]
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(texts * 5, trainers.BpeTrainer(
        vocab_size=400, special_tokens=list(SPECIAL_TOKENS[:3]), initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    # Qwen's tokenizers hold the vision tokens as added special tokens after the BPE vocabulary.
    tokenizer.add_special_tokens({"additional_special_tokens": [AddedToken(t, normalized=False, special=True)
                                                                for t in VISION_TOKENS]})
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(directory)
    return tokenizer


def _processor_files(directory: Path, family: str) -> None:
    image_type, video_type, mean, std = _PROCESSOR[family]
    geometry = {"patch_size": PATCH, "merge_size": MERGE, "temporal_patch_size": TEMPORAL}
    image = {"image_processor_type": image_type, "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255,
             "do_normalize": True, "do_convert_rgb": True, "resample": 3, "image_mean": mean, "image_std": std,
             "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}, **geometry}
    # Qwen3-VL's video bounds hold for the whole clip (video_pixels_per "clip"), Qwen2's for each frame.
    clip = 4 if family == "qwen3_vl" else 1
    video = {"video_processor_type": video_type, "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255,
             "do_normalize": True, "do_convert_rgb": True, "resample": 3, "image_mean": mean, "image_std": std,
             "size": {"shortest_edge": MIN_PIXELS * clip, "longest_edge": MAX_PIXELS * clip},
             "fps": 2.0, "min_frames": 2, "max_frames": 4, "do_sample_frames": True, **geometry}
    (directory / "preprocessor_config.json").write_text(json.dumps(image, indent=2) + "\n")
    (directory / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2) + "\n")


def make_vl_checkpoint(directory, family: str = "qwen2_5_vl", seed: int = 0, *, tokenizer=None,
                       text_fields: dict | None = None, tie_word_embeddings: bool = True) -> dict:
    """Write a tiny random `family` checkpoint (model, tokenizer, processor files) into `directory`.

    `tokenizer` (already saved in `directory`) replaces the smoke BPE tokenizer and `text_fields` are laid over
    the text config (tests/hub_checkpoints.py: the hub's tokens, template and config fields).

    Returns what tests compare against: family, directory, the four vision token ids (equal in the
    tokenizer and in config.json), vocab_size (= the tokenizer's length), the transformers class name
    and the media_kwargs its processor files state."""
    import torch
    import transformers

    if family not in _VISION:
        raise ValueError(f"family {family!r}; choose one of {', '.join(FAMILIES)}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer if tokenizer is not None else _tokenizer(directory)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    config_cls, model_cls, vision = _VISION[family]
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, initializer_range=0.1,
                bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                pad_token_id=ids["<|endoftext|>"],
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                 **({"mrope_interleaved": True} if family == "qwen3_vl" else {})},
                **({"head_dim": 16, "attention_bias": False} if family == "qwen3_vl" else {}))
    text_fields = dict(text_fields or {})
    if "rope_theta" in text_fields:
        text["rope_parameters"]["rope_theta"] = float(text_fields.pop("rope_theta"))
    text.update(text_fields)
    config = getattr(transformers, config_cls)(
        text_config=text, vision_config=dict(num_heads=2, patch_size=PATCH, spatial_merge_size=MERGE,
                                             temporal_patch_size=TEMPORAL, initializer_range=0.1, **vision),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float().eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.ndim == 1:
                base = 1.0 if ("norm" in name or "ln_q" in name) and name.endswith("weight") else 0.0
                parameter.copy_(base + 0.3 * torch.randn_like(parameter))
    model.save_pretrained(directory)
    _processor_files(directory, family)
    return {"family": family, "directory": directory, "vocab_size": len(tokenizer), "model_class": model_cls,
            "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
            "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
            "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"],
            "patch_size": PATCH, "merge_size": MERGE, "temporal_patch_size": TEMPORAL,
            "min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS}


@pytest.fixture(scope="session")
def vl_checkpoint(tmp_path_factory):
    """`vl_checkpoint(family="qwen2_5_vl", seed=0)` → (directory, info), written once per run, on every
    xdist worker (tests/once_per_run.py). Read-only for tests: copy it before changing a file."""

    def make(family: str = "qwen2_5_vl", seed: int = 0) -> tuple[Path, dict]:
        directory, info = build_once(tmp_path_factory, f"vl-checkpoint-{family}-{seed}",
                                     lambda directory: make_vl_checkpoint(directory, family, seed))
        return directory, {**info, "directory": directory}

    return make

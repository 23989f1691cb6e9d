"""Tiny random checkpoints shaped like the hub ones users download, with the hub's own chat templates.

`make_hub_checkpoint(directory, family)` writes, with transformers and no hub, a checkpoint folder as
`save_pretrained` writes one for the hub model `tests/fixtures/hub/FAMILY/` names (PROVENANCE.md there):
- the tokenizer: a small byte-level BPE vocabulary trained on the smoke texts, then the hub tokenizer's added
  tokens in their order and with their `special` flags (Qwen's `<tool_call>` is added but not special, as on
  the hub), the hub `tokenizer_config.json` fields, and the checkpoint's chat template verbatim (no
  `{% generation %}` markers: what every hub checkpoint ships); Llama's post-processor prepends
  `<|begin_of_text|>` as the hub `tokenizer.json` does;
- the model: hub architecture and config fields (token ids, rope theta and scaling, tie_word_embeddings, ...)
  at tiny widths (64 wide, 2 layers) and random weights; `max_position_embeddings` is 16,384 (not the hub's
  value) so that an export which writes any default in its place is caught;
- `generation_config.json` with the hub's eos list and sampling defaults;
- for the VL families, the processor files and vision tower of `tests/vl_checkpoints.py`.

`hub_checkpoint(family)` (a session fixture) builds each family once per test run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.once_per_run import build_once

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests/fixtures/hub"
TEXT_FAMILIES = ("qwen2_5", "qwen3", "llama3_1", "llama3_2")
VL_FAMILIES = ("qwen2_5_vl", "qwen3_vl")
FAMILIES = TEXT_FAMILIES + VL_FAMILIES
MAX_POSITIONS = 16384
_TEXT_WIDTHS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, initializer_range=0.1)


def family_spec(family: str) -> dict:
    if family not in FAMILIES:
        raise ValueError(f"family {family!r}; choose one of {', '.join(FAMILIES)}")
    return json.loads((FIXTURES / family / "family.json").read_text())


def chat_template(family: str) -> str:
    return (FIXTURES / family / "chat_template.jinja").read_text()


def _corpus() -> list[str]:
    texts = []
    for name in ("data/smoke/chat/train.jsonl", "data/smoke/vflash/points.jsonl"):
        for line in (ROOT / name).read_text().splitlines():
            texts.append(line)
    return texts


def build_tokenizer(directory: Path, family: str):
    """The family's tokenizer (see the module docstring), saved into `directory`; returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import AddedToken, PreTrainedTokenizerFast

    spec = family_spec(family)
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(_corpus() * 3, trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    raw.add_tokens([AddedToken(token, special=special, normalized=False) for token, special in spec["added_tokens"]
                    if not special])
    raw.add_special_tokens([AddedToken(token, special=True, normalized=False)
                            for token, special in spec["added_tokens"] if special])
    # Added in hub order: rebuild so the ids follow the hub's order (specials and plain tokens interleaved).
    vocab_end = raw.get_vocab_size(with_added_tokens=False)
    raw = Tokenizer.from_str(raw.to_str())
    ordered = {token: vocab_end + k for k, (token, _) in enumerate(spec["added_tokens"])}
    data = json.loads(raw.to_str())
    data["added_tokens"] = [{"id": ordered[token], "content": token, "single_word": False, "lstrip": False,
                             "rstrip": False, "normalized": False, "special": special}
                            for token, special in spec["added_tokens"]]
    raw = Tokenizer.from_str(json.dumps(data))
    fields = dict(spec["tokenizer"])
    if fields.pop("prepend_bos", False):
        bos = fields["bos_token"]
        raw.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, ordered[bos])])
    fields.pop("tokenizer_class", None)
    extra_special = fields.pop("additional_special_tokens", None)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, **{k: v for k, v in fields.items() if v is not None})
    if extra_special:
        tokenizer.add_special_tokens({"additional_special_tokens": extra_special})
    tokenizer.chat_template = chat_template(family)
    tokenizer.save_pretrained(directory)
    assert [tokenizer.convert_tokens_to_ids(t) for t, _ in spec["added_tokens"]] == list(ordered.values())
    return tokenizer


def _ids(tokenizer, fields: dict) -> dict:
    """`*_token` / `*_tokens` entries (token strings) as the `*_token_id` fields transformers reads."""
    out = {}
    for key, value in fields.items():
        if key.endswith("_tokens"):
            out[key[: -len("_tokens")] + "_token_id"] = [tokenizer.convert_tokens_to_ids(t) for t in value]
        elif key.endswith("_token"):
            out[key + "_id"] = tokenizer.convert_tokens_to_ids(value)
        else:
            out[key] = value
    return out


def _perturb_vectors(model, seed: int) -> None:
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.ndim == 1:
                base = 1.0 if "norm" in name and name.endswith("weight") else 0.0
                parameter.copy_(base + 0.3 * torch.randn_like(parameter))


def make_hub_checkpoint(directory, family: str, seed: int = 0) -> dict:
    """Write the tiny `family` checkpoint into `directory`; returns what tests compare against."""
    import torch
    import transformers

    spec = family_spec(family)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(directory, family)
    config_fields = _ids(tokenizer, spec["config"])
    config_fields.pop("torch_dtype", None)
    if family in VL_FAMILIES:
        from tests.vl_checkpoints import make_vl_checkpoint

        vl_family = {"qwen2_5_vl": "qwen2_5_vl", "qwen3_vl": "qwen3_vl"}[family]
        info = make_vl_checkpoint(directory, vl_family, seed, tokenizer=tokenizer,
                                  text_fields={k: v for k, v in config_fields.items()
                                               if k not in ("tie_word_embeddings",)} | {
                                      "max_position_embeddings": MAX_POSITIONS},
                                  tie_word_embeddings=config_fields.get("tie_word_embeddings", False))
    else:
        config_cls = {"qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "llama": "LlamaConfig"}[spec["model_type"]]
        extra = {"head_dim": 16} if spec["model_type"] == "qwen3" else {}
        config = getattr(transformers, config_cls)(vocab_size=len(tokenizer), **_TEXT_WIDTHS, **extra,
                                                   **{**config_fields, "max_position_embeddings": MAX_POSITIONS})
        config.architectures = [spec["architecture"]]
        torch.manual_seed(seed)
        model = getattr(transformers, spec["architecture"])(config).float().eval()
        _perturb_vectors(model, seed)
        model.save_pretrained(directory)
        info = {"family": family, "model_class": spec["architecture"], "vocab_size": len(tokenizer)}
    generation = _ids(tokenizer, spec["generation_config"])
    transformers.GenerationConfig(**generation).save_pretrained(directory)
    return {**info, "family": family, "directory": directory, "hub_id": spec["hub_id"],
            "eos_token_id": tokenizer.eos_token_id, "bos_token_id": config_fields.get("bos_token_id"),
            "max_position_embeddings": MAX_POSITIONS, "vision": family in VL_FAMILIES}


@pytest.fixture(scope="session")
def hub_checkpoint(tmp_path_factory):
    """`hub_checkpoint(family, seed=0)` → (directory, info), written once per run on every xdist worker.
    Read-only for tests: copy it before changing a file."""

    def make(family: str, seed: int = 0) -> tuple[Path, dict]:
        directory, info = build_once(tmp_path_factory, f"hub-checkpoint-{family}-{seed}",
                                     lambda directory: make_hub_checkpoint(directory, family, seed))
        return directory, {**info, "directory": directory}

    return make

"""The config groups every task shares; each `configs/TASK.py` states only what differs.

    from configs import common
    config = common.base_config("chat", data=common.data_group(...), vision=True)
    return common.apply_variant(config, variant, "configs/chat.py")

Groups, their keys and defaults (with what each key means) are declared once in
`valen_jax.config.schema`, which also validates a config once at start-up: `data`,
`media_kwargs`, `model`, `train`, `loss`, `mesh`, `eval`. Variants after `:`: none = the CPU
smoke run; `tiny` = the smallest model and a few steps, for tests; `hf` = start from an HF
checkpoint, a directory or hub name (`--config.model.init_from=PATH --config.data.tokenizer=PATH`):
- a VLM (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): the whole VLM is imported, decoder, vision tower, M-RoPE and
  media tokens (the tokenizer must be the checkpoint's: its vision token ids are checked); the
  `model.vision` keys come from the checkpoint and must stay unset. Freeze the tower with
  `--config.train.param_groups='({"pattern": "vision/.*", "frozen": True},)'`.
- a text model (Qwen2, Qwen3, Llama): its decoder is imported and the model has no vision tower (seed 003:
  the base of a run on images must accept them), so image rows are refused before the run starts, naming
  their PATH:LINE; `model.vision` keys must stay unset (or `--config.model.vision=None`).

Training on your own files takes four keys (python -m valen_jax.train --config=configs/chat.py:hf,lora ...):
- `model.init_from`: the HF checkpoint to start from (a directory or hub name);
- `data.tokenizer`: its tokenizer, usually the same directory. A hub tokenizer's inference template has no
  `{% generation %}` markers: the training template of `data.template_family` (default chatml; llama3)
  is installed for every conversion the run makes;
- `data.train`: your training file in `data.format` (or a shard directory from `python -m data_pipeline.convert`);
- `data.eval`: your held-out file in `data.eval_format`, which the run evaluates during training
  (`eval.every`) and at its end (`eval.at_end`, the report names it); `--config.data.eval=None` trains
  without evaluation. Your own `data.train` beside a bundled smoke `data.eval` that the run would evaluate
  is refused, so a report never scores your model on the smoke set by default.
`--config.KEY=None` unsets any key, a group included (`--config.model.vision=None`: a text model from scratch).
"""

from __future__ import annotations

from pathlib import Path

import ml_collections

from valen_jax.config.schema import ARCHITECTURE_KEYS, defaults

ROOT = Path(__file__).resolve().parent.parent


def data_group(fmt: str, train: str, eval_path: str, eval_format: str, *, seq_len: int, max_patches: int,
               global_batch: int = 16, train_options: dict | None = None,
               eval_options: dict | None = None) -> ml_collections.ConfigDict:
    # Held-out data (`eval`) serves evaluation during training (eval.every) and at the end (eval.at_end).
    return defaults("data", format=fmt, train=str(ROOT / train), eval=str(ROOT / eval_path), eval_format=eval_format,
                    train_options=dict(train_options or {}), eval_options=dict(eval_options or {}),
                    tokenizer=str(ROOT / "data/tokenizer"), seq_len=seq_len, max_patches=max_patches,
                    global_batch=global_batch)


def model_group(vision: bool) -> ml_collections.ConfigDict:
    return defaults("model", vision=defaults("vision") if vision else None)


TOKENS_ONLY = {"tokens": 1.0, "branches": 0.0, "drafter": 0.0}


def base_config(task: str, data: ml_collections.ConfigDict, vision: bool,
                loss_weights: dict[str, float] = TOKENS_ONLY) -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.task = task
    config.data = data
    config.media_kwargs = defaults("media_kwargs")
    config.model = model_group(vision)
    config.train = defaults("train")
    config.loss = defaults("loss", weights=dict(loss_weights))
    config.mesh = defaults("mesh")
    config.eval = defaults("eval")
    return config


# Variants that add adapters, alone or after a size variant (`:hf,lora`, `:tiny,qlora`): config.model.lora
# with its defaults (rank 16, alpha 32, every linear layer of the decoder); qlora also stores that base as NF4.
ADAPTER_VARIANTS = ("lora", "qlora")


def apply_variant(config: ml_collections.ConfigDict, variant: str, name: str) -> ml_collections.ConfigDict:
    parts = [part for part in variant.split(",") if part] if variant else []
    sizes = [part for part in parts if part not in ADAPTER_VARIANTS]
    adapters = [part for part in parts if part in ADAPTER_VARIANTS]
    if len(sizes) > 1 or len(adapters) > 1:
        raise ValueError(f"{name}: variant {variant!r}: at most one of tiny, hf, then optionally lora or qlora")
    config = _apply_size(config, sizes[0] if sizes else "", name)
    if adapters:
        config.model.lora = defaults("lora", quantize_base="nf4" if adapters[0] == "qlora" else "none")
        # Adapters start at zero and move only a low-rank update: they take a larger step than full
        # fine-tuning's (PEFT's examples use 1e-4 to 2e-4).
        config.train.learning_rate = max(float(config.train.learning_rate), 2e-4)
    return config


def _apply_size(config: ml_collections.ConfigDict, variant: str, name: str) -> ml_collections.ConfigDict:
    if variant == "tiny":
        config.model.dim = 64
        config.model.num_layers = 2
        config.model.head_dim = 16
        config.model.mlp_dim = 128
        if config.model.vision is not None:
            config.model.vision.dim = 32
            config.model.vision.num_layers = 1
            config.model.vision.mlp_dim = 64
        config.data.global_batch = 8
        config.train.steps = 6
        config.train.checkpoint_every = 3
        config.train.log_every = 1
        config.train.warmup_steps = 2
        config.eval.every = 0
        config.eval.max_examples = 8
        config.eval.max_new_tokens = 16
    elif variant == "hf":
        # The decoder comes from the checkpoint; so does the vision tower of a VLM checkpoint, while a text
        # checkpoint gets none. Unset, not defaulted, so a key set next to either is seen and refused
        # (models/build.py).
        for key in ARCHITECTURE_KEYS:
            config.model[key] = None
        if config.model.vision is not None:
            for key in config.model.vision:
                config.model.vision[key] = ml_collections.config_dict.placeholder(type(config.model.vision[key]))
        config.model.init_from = ml_collections.config_dict.placeholder(str)
        config.model.coordinate_embeddings = "random"  # the checkpoint's rows are kept
        config.model.dtype = "bfloat16"
        config.model.remat = "full"
        config.model.scan_layers = True
        config.train.learning_rate = 2e-5
        config.train.steps = 1000
        config.train.checkpoint_every = 200
        config.eval.every = 200
    elif variant:
        raise ValueError(f"{name}: unknown variant {variant!r}; known: tiny, hf, lora, qlora")
    return config

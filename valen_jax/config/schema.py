"""The training config's schema: every group's keys with their defaults, and the start-up checks.

`configs/common.py` builds its groups from `defaults(GROUP)`, and `validate_config` requires
exactly the keys listed here, so a key is added in one place. Keys whose default is `NO_DEFAULT`
(the data files and their formats) must be given by each `configs/TASK.py`.

The schema also declares the config's vocabulary that the training pieces implement (objectives, loss
reductions, decays, parameter-group keys: `losses` and `optim` read them from here) and imports only
leaves (`errors`, `data.media_defaults`, the attention and remat names), so data, models and
training code can all read it without an import circle (tests/test_import_contract.py).
"""

from __future__ import annotations

import math
import numbers
import os
import re
from collections.abc import Sequence
from typing import Any

import ml_collections
from ml_collections import config_dict

from data_pipeline.cli_paths import PathError, check_path
from valen_jax.data.media_defaults import MEDIA_DEFAULTS
from valen_jax.errors import ConfigError, ParamGroupError  # ConfigError's home; still importable from here
from valen_jax.models.attention import IMPLEMENTATIONS as ATTENTION_IMPLEMENTATIONS
from valen_jax.models.remat import REMAT_POLICIES

NO_DEFAULT = object()
DTYPES = ("float32", "bfloat16")
# The config's vocabulary that the training pieces implement (losses.py, optim.py read it from here,
# so the schema checks a config without importing the training layer).
OBJECTIVES = ("tokens", "branches", "drafter")  # config.loss.weights' keys
LOSS_REDUCTIONS = ("state_mean", "question_mean")  # config.loss.loss_reduction
COORDINATE_EMBEDDINGS = ("random", "fourier")  # config.model.coordinate_embeddings
DECAYS = ("cosine", "linear")  # config.train.decay, after warmup
PARAM_GROUP_KEYS = {"pattern", "frozen", "lr_multiplier"}  # one of config.train.param_groups
# The decoder's shape: from `model.init_from`'s config.json when set, from the config otherwise.
ARCHITECTURE_KEYS = ("dim", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim", "rope_theta",
                     "tie_embeddings")


def _data() -> dict[str, Any]:
    return {
        # The run's own files (configs/common.py: the four keys of training on them). `eval` is evaluated during
        # training (eval.every) and at its end (eval.at_end); None trains without evaluation. Own `train` data
        # with a bundled smoke `eval` set is refused (valen_jax.training.preflight).
        "format": NO_DEFAULT, "train": NO_DEFAULT, "eval": NO_DEFAULT, "eval_format": NO_DEFAULT,
        # Converter options per set (data_pipeline.format_registry), e.g. vakforge's {"split": "train"}.
        "train_options": {}, "eval_options": {},
        # The tokenizer (usually model.init_from's directory). template_family: the training template (chatml,
        # llama3) installed when the tokenizer's own has no {% generation %} markers, as every hub checkpoint's
        # inference template; "auto": the family that template writes (Qwen: chatml, Llama 3.x: llama3). Every
        # conversion the run makes uses it (valen_jax.data.shard_cache).
        "tokenizer": NO_DEFAULT, "template_family": "auto",
        "seq_len": NO_DEFAULT,
        # Vision patches per row (before merging); 0 for text-only data.
        "max_patches": NO_DEFAULT,
        "global_batch": 16, "workers": 0, "shuffle": True,
        # Packing several examples per row (segment ids keep them apart): "none", "first_fit" or
        # "best_fit"; at most max_segments per row; an example longer than a row is an "error" or a
        # counted "skip" (never truncated: a cut could split a media placeholder).
        "packing": "none", "max_segments": 16, "overlong": "error", "pack_buffer": 32,
        # Valen (seed 000): "question" (branch tree) or "shared_state"; row capacity in questions and
        # candidates. Unused by the token formats.
        "valen_mode": "question", "max_questions": 8, "max_candidates": 16,
        # Seed 003: train and eval must not share examples, Valen group_ids, media or vakforge
        # conversations; True trains anyway and records the overlap counts (valen_jax/data/separation.py).
        "allow_overlap": False,
        # data.train / data.eval may be registry references (ns/name[:vN|:alias|@sha256:…]): the registry
        # URL ("" = $VALEN_REGISTRY or the user cache) and the namespace of a reference without one.
        "registry": "", "namespace": "",
    }


def _drafter() -> dict[str, Any]:
    # VFlash's block drafter (valen_jax/models/drafter.py); its width, heads and vocabulary are the target's.
    return {
        # Tokens proposed per forward pass (mask slots after the anchor); DFlash uses 16.
        "block_size": 16,
        "num_layers": 1,
        # Target layers whose outputs are fused into the drafter's context; () = up to 5 spread over the depth.
        "target_layers": (),
        # Anchors drafted per row and step: every primitive block's first anchor, then positions inside
        # blocks drawn at random (DFlash samples 512 per sequence).
        "anchors_per_row": 64,
        # Position k of a block weighs exp(-(k-1)/gamma): acceptance is a prefix (DFlash: 7 for blocks of 16).
        "position_decay": 7.0,
    }


def _model() -> dict[str, Any]:
    return {
        # An HF checkpoint (directory or hub name) to start from; its config.json fixes the architecture. A
        # vision-language one brings its tower; a text one has none (seed 003), so image rows are refused.
        "init_from": "",
        "dim": 128, "num_layers": 3, "num_heads": 4, "num_kv_heads": 2, "head_dim": 32, "mlp_dim": 384,
        "rope_theta": 10000.0, "tie_embeddings": True,
        # Compute dtype; parameters (and so Adam's updates) stay float32 master weights.
        "dtype": "float32", "param_dtype": "float32",
        # What each decoder layer keeps for the backward (valen_jax.models.remat): "none", "full"
        # (recompute the layer), "save_dots" (keep the weight matmuls' outputs), "offload" (those, in host memory).
        "remat": "none", "scan_layers": False,
        # Attention kernel of every layer, decoder and vision (valen_jax.models.attention): auto picks
        # blockwise on CPU, cudnn on GPU, splash on TPU, and logs its choice.
        "attention": "auto",
        # A `defaults("vision")` group, or None for a text-only model (--config.model.vision=None).
        "vision": None,
        # How a fresh model's embedding rows of the coordinate tokens <0>..<1000> start (tied: also the
        # head's): "random" like every row, or "fourier": row <v> = Σ_k cos(πkv/1000)·c_k + sin(πkv/1000)·s_k
        # over dim/4 frequencies and random orthonormal c_k, s_k (valen_jax.models.build.fourier_coordinate_rows),
        # so neighbouring values start with near logits and a hidden state can point at a place with one
        # direction (issue 25). Only for a fresh model: an imported checkpoint keeps its own rows.
        "coordinate_embeddings": "random",
        # train.mode="vflash" (seed 004's --training_mode): the `ar` workdir whose latest checkpoint is the
        # frozen target, and the block drafter trained against it (read only in that mode).
        "target_from": "",
        "drafter": _drafter(),
        # A `defaults("lora")` group: low-rank adapters on the decoder (valen_jax.models.lora), the base
        # frozen; or None to train every parameter.
        "lora": None,
    }


LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")  # the decoder's linear layers (models/lora.DECODER)
# The vision towers' linear layers, targeted as "vision/<name>" (models/lora.VISION_LINEARS: which a tower
# family has is checked when the model is built, once the checkpoint says which tower it is).
LORA_VISION_TARGETS = tuple(f"vision/{name}" for name in (*LORA_TARGETS, "qkv", "proj", "fc1", "fc2", "merge_in",
                                                           "merge_out"))
LORA_QUANTIZE_BASE = ("none", "nf4")


def _lora() -> dict[str, Any]:
    return {
        # Adapter rank r and alpha: the update is (alpha / r)·A·B (PEFT's scaling; use_rslora off).
        "rank": 16, "alpha": 32.0,
        # Dropout on each adapter's input (PEFT's lora_dropout) in training only, its masks drawn per step from
        # config.train.seed (a resume draws the same); evaluation and decoding run without it.
        "dropout": 0.0,
        # Which of the decoder's linear layers get adapters (every layer's): attention q/k/v/o, MLP gate/up/down;
        # "vision/<name>" adds the vision tower's (every block's, e.g. vision/qkv, vision/proj, vision/down) or
        # the patch merger's (vision/merge_in, vision/merge_out). Without them an imported tower stays frozen.
        "targets": LORA_TARGETS,
        # "nf4": QLoRA, the targeted base weights stored as 4-bit NormalFloat (block 64) and dequantised per
        # layer in the forward; "none": the base kept in config.model.param_dtype.
        "quantize_base": "none",
        # Regexes over '/'-joined parameter paths of base parameters that train beside the adapters (a new
        # head, say `lm_head`); each must match one. A Valen score head always trains.
        "trainable": (),
        # A PEFT adapter folder (adapter_config.json + adapter_model.safetensors, ours or PEFT's) whose adapters
        # a fresh run starts from instead of fresh ones: its rank, alpha and targets must be this group's.
        "init_adapter": "",
    }


def _vision() -> dict[str, Any]:
    return {"patch_size": 8, "merge_size": 2, "temporal_patch_size": 2, "dim": 96, "num_layers": 2, "num_heads": 4,
            "mlp_dim": 256,
            # Fixed 2-D sin/cos embeddings of each patch's place added to the patch embeddings
            # (valen_jax.models.vision.grid_position_embeddings); see VisionConfig.absolute_positions.
            # On for a fresh tower: without them a token on a uniform background cannot tell where it is
            # (issue 25). A checkpoint's model.json without the key restores as it was trained (off).
            "absolute_positions": True,
            # Each patch is embedded beside a copy of its pixels standardised over its image, per colour channel
            # (valen_jax.models.image_norm.standardised): on backgrounds whose colour changes from image to image a
            # plain patch embedding leaves a 5-px object all but invisible to a fresh tower (issue 55). On for a
            # fresh tower; a model.json without the key restores as it was trained (off).
            "standardise_pixels": True}


def _train() -> dict[str, Any]:
    return {
        # Seed 004's --training_mode: "ar" trains the model itself; "vflash" trains a block drafter for the
        # frozen target in model.target_from (loss.weights: drafter > 0, tokens and branches 0).
        "mode": "ar",
        "steps": 160, "checkpoint_every": 80, "keep_checkpoints": 3,
        # zstd on state arrays: f32 weights and moments shrink ~7% for 2-3x the writer's CPU time.
        "checkpoint_compression": False,
        # True: a workdir left without an intact checkpoint (all moved to checkpoints-corrupt/) trains
        # from step 0 instead of being refused. A permission, not an order: an intact checkpoint is resumed.
        "allow_fresh_start": False,
        "seed": 0, "log_every": 20,
        "learning_rate": 3e-3, "warmup_steps": 20,
        "decay": "cosine",  # after warmup: "cosine" or "linear" down to end_learning_rate_fraction
        "end_learning_rate_fraction": 0.05,
        "weight_decay": 0.01, "adam_b1": 0.9, "adam_b2": 0.95, "grad_clip_norm": 1.0,
        # Micro-batches per step, accumulated inside the compiled step: same update as one batch.
        "grad_accum_steps": 1,
        # [{"pattern": REGEX over the '/'-joined param path, "frozen": True | "lr_multiplier": x}], first match wins.
        # A tuple: ml_collections overrides tuples (not lists) from the command line,
        # --config.train.param_groups='({"pattern": "vision/.*", "frozen": True},)'.
        "param_groups": (),
        # The learning rate of the vision tower (parameters under `vision/`, ours or an imported Qwen-VL
        # tower) as a fraction of the schedule's, applied after param_groups (a group matching a tower
        # parameter wins). Adam moves every element by about the learning rate whatever its gradient, and
        # the tower's gradients are tiny and nearly rank one (most patches are background): at the full rate
        # each tower matrix grows a shared direction step after step until every vision token is one vector
        # and the decoder learns to answer from the text (issue 25; README "Vision tower learning rate").
        "vision_lr_multiplier": 0.1,
        # Peak FLOP/s per device for MFU; None: from the device kind's datasheet, measured on CPU.
        # A fresh placeholder per config: a shared FieldReference would tie two configs together.
        "peak_flops": ml_collections.config_dict.placeholder(float),
    }


def _loss() -> dict[str, Any]:
    return {
        # Every objective named explicitly; one a batch cannot provide must weigh 0.
        "weights": NO_DEFAULT,
        # PaLM's z-loss coefficient on log(Z)² of the token softmax; 0 = off (1e-4 is the usual value).
        "z_loss": 0.0,
        # Valen's loss_reduction (seed 000): "state_mean" averages questions within a state, then states.
        "loss_reduction": "state_mean",
        # Soft targets for the coordinate tokens <0>..<1000> (valen_jax.training.losses.coordinate_targets): a target
        # <v> is scored against a Gaussian of this width (in token units) over the neighbouring values
        # instead of one-hot; 0 = one-hot. One-hot cross-entropy treats <499> as as wrong as <0> for <500>
        # and trains each of the 1001 coordinate rows of the head only from the records with that exact
        # value, so a from-scratch model never learns a point's place (issue 25). The width anneals
        # geometrically from this value to `coordinate_sigma_final` over train.steps (None: constant).
        "coordinate_sigma": 0.0,
        "coordinate_sigma_final": config_dict.placeholder(float),
    }


def _mesh() -> dict[str, Any]:
    # -1 means "the rest of the devices". All unset: chosen at start-up from the model's size and the target
    # devices' memory, data parallel or FSDP (valen_jax.training.mesh_choice); some set: the others are 1,
    # `data` the rest.
    return {axis: config_dict.placeholder(int) for axis in ("data", "fsdp", "tensor")}


def _eval() -> dict[str, Any]:
    return {
        "at_end": True,
        # Teacher-forced loss/accuracy on data.eval every this many steps (eval_* in metrics.jsonl); 0 = off.
        "every": 80,
        "batch_size": 16, "max_examples": 32, "max_new_tokens": 64,
    }


def _rl() -> dict[str, Any]:
    # train.mode="reinforce" (issue 32, seed 003's reinforcement runs): the group the mode reads, present
    # only in its configs. Value checks (ranges, reward names) are `valen_jax.reinforce.settings.check`'s,
    # made before any device is claimed; this schema owns the keys and their defaults.
    return {
        "group_size": 8,  # G completions sampled per prompt
        # Prompts per rollout batch: the data stream's batch, so config.data.global_batch must equal it.
        "prompts_per_rollout": 8,
        "inner_steps": 2,  # optimizer updates per rollout batch (old log-probs kept from rollout time)
        "clip_epsilon": 0.2,  # the ratio's clip range [1 - eps, 1 + eps]
        # > 0: a frozen reference (the starting checkpoint) is kept and the k3 KL to it is added with
        # this weight; 0 keeps no reference.
        "kl_coef": 0.0,
        "scale_by_std": True,  # GRPO's advantage scaling by the group's std; False is Dr.GRPO's
        "max_new_tokens": 16,  # per completion; prompt + completion must fit config.data.seq_len
        "temperature": 1.0, "top_p": 1.0,
        # Reward name -> explicit weight (valen_jax.reinforce.rewards.REWARDS, and "grader").
        "rewards": {"exact": 1.0},
        # A gold answer (the assistant message: its text and tool calls, as JSON) travels with its prompt
        # in the data stream, padded to this many bytes; a longer one is refused naming its row.
        "gold_bytes": 1024,
        # An SFT workdir (train.mode=ar) whose latest checkpoint the policy starts from (and the KL
        # reference); its architecture and tokenizer are the run's. Unset: config.model (init_from or fresh).
        "from_workdir": config_dict.placeholder(str),
        # The "grader" reward: a model prompted with graderInstructions (seed 003): another workdir's
        # latest checkpoint; unset = the policy's starting checkpoint.
        "grader_instructions": "", "grader_workdir": config_dict.placeholder(str),
        "grader_max_new_tokens": 8,
    }


def _media_kwargs() -> dict[str, Any]:
    # Passed to the media processor and saved in the checkpoint (seed 000, "Images and video").
    # None (unset): the base model's processor setting (config.model.init_from), or for a model
    # trained from scratch the smoke default, both resolved at start-up (`media_kwargs_of`).
    return {key: config_dict.placeholder(type(value)) for key, value in MEDIA_DEFAULTS.items()}


TRAIN_MODES = ("ar", "vflash")  # the built-in modes, whose keys this schema checks
REINFORCE = "reinforce"  # the mode that reads config.rl (valen_jax.tasks.reinforce)

_GROUPS = {"data": _data, "media_kwargs": _media_kwargs, "model": _model, "vision": _vision, "drafter": _drafter,
           "lora": _lora,
           "train": _train,
           "loss": _loss, "mesh": _mesh, "eval": _eval, "rl": _rl}
# The top-level groups of a config (`vision` and `drafter` sit inside `model`).
GROUPS = ("data", "media_kwargs", "model", "train", "loss", "mesh", "eval")
REQUIRED = {group: tuple(_GROUPS[group]()) for group in GROUPS}
OPTIONAL_GROUPS = ("rl",)  # present only where their mode reads them


def defaults(group: str, **values: Any) -> ml_collections.ConfigDict:
    """A fresh `group` ConfigDict: its defaults with `values` over them; keys without a default must be given."""
    fields = _GROUPS[group]()
    unknown = set(values) - set(fields)
    if unknown:
        raise ConfigError(f"config.{group} has no key {', '.join(sorted(unknown))}")
    fields.update(values)
    missing = [key for key, value in fields.items() if value is NO_DEFAULT]
    if missing:
        raise ConfigError(f"config.{group}: {', '.join(missing)} must be given (no default)")
    return ml_collections.ConfigDict(fields)


def _check_keys(where: str, group: ml_collections.ConfigDict, keys) -> None:
    missing = [k for k in keys if k not in group]
    if missing:
        raise ConfigError(f"config.{where} lacks {', '.join(missing)}")
    # A key the schema does not know would be read by nothing: a typo must not pass silently.
    unknown = sorted(set(group) - set(keys))
    if unknown:
        raise ConfigError(f"config.{where} has unknown keys {', '.join(unknown)}; known: {', '.join(keys)}")


def validate_config(config: ml_collections.ConfigDict) -> None:
    unknown = sorted(set(config) - set(GROUPS) - set(OPTIONAL_GROUPS) - {"task"})
    if unknown:
        raise ConfigError(f"config has unknown groups {', '.join(unknown)}; known: task, "
                          f"{', '.join(GROUPS + OPTIONAL_GROUPS)}")
    for group, keys in REQUIRED.items():
        if group not in config:
            raise ConfigError(f"config has no group {group!r}")
        _check_keys(group, config[group], keys)
    if config.model.vision is not None:
        _check_keys("model.vision", config.model.vision, tuple(_vision()))
    if config.model.drafter is not None:
        _check_keys("model.drafter", config.model.drafter, tuple(_drafter()))
    if config.model.lora is not None:
        _validate_lora(config)
    for path in ("data.seq_len", "data.global_batch", "train.steps", "train.checkpoint_every",
                 "train.log_every", "eval.batch_size"):
        group, key = path.split(".")
        if int(config[group][key]) <= 0:
            raise ConfigError(f"config.{path} must be positive, got {config[group][key]}")
    if config.data.workers < 0:
        raise ConfigError("config.data.workers must be ≥ 0")
    if config.train.keep_checkpoints is not None and int(config.train.keep_checkpoints) < 1:
        raise ConfigError("config.train.keep_checkpoints must be ≥ 1 (None keeps all)")
    _validate_paths(config)
    _validate_optimisation(config)
    _validate_loss(config.loss)
    _validate_mode(config)
    _validate_rl_keys(config)
    if config.model.coordinate_embeddings not in COORDINATE_EMBEDDINGS:
        raise ConfigError(f"config.model.coordinate_embeddings={config.model.coordinate_embeddings!r}; choose one of "
                          f"{', '.join(COORDINATE_EMBEDDINGS)}")
    if int(config.eval.every) < 0:
        raise ConfigError(f"config.eval.every must be ≥ 0 (0: no evaluation during training), got {config.eval.every}")
    if config.model.init_from:
        init_from = str(config.model.init_from)
        if init_from.startswith(("/", ".", "~")) and not os.path.isdir(os.path.expanduser(init_from)):
            # A local path (a hub name is `org/model`): say it is missing before any other complaint about it.
            raise ConfigError(f"config.model.init_from={init_from!r}: no such directory (a Hugging Face checkpoint "
                              "directory, or a hub name org/model)")
        if config.model.coordinate_embeddings != "random":
            raise ConfigError(f"config.model.coordinate_embeddings={config.model.coordinate_embeddings!r} shapes a "
                              f"fresh model's rows; with config.model.init_from the checkpoint's rows are kept "
                              f"(set it to 'random', as the :hf variants do)")
        # The checkpoint fixes the architecture; a value here too would be silently ignored.
        clashing = [k for k in ARCHITECTURE_KEYS if config.model[k] is not None]
        if clashing:
            raise ConfigError(f"config.model.init_from is set, so {', '.join(clashing)} come from the checkpoint; "
                              "set them to None (the :hf variants do)")


def _validate_lora(config: ml_collections.ConfigDict) -> None:
    lora = config.model.lora
    _check_keys("model.lora", lora, tuple(_lora()))
    if not (isinstance(lora.rank, int) and not isinstance(lora.rank, bool) and lora.rank >= 1):
        raise ConfigError(f"config.model.lora.rank must be an integer ≥ 1, got {lora.rank!r}")
    if not _finite("model.lora.alpha", lora.alpha) > 0:
        raise ConfigError(f"config.model.lora.alpha must be a finite number > 0, got {lora.alpha!r}")
    if not 0.0 <= _finite("model.lora.dropout", lora.dropout) < 1.0:
        raise ConfigError(f"config.model.lora.dropout={lora.dropout!r}: a probability in [0, 1)")
    targets = tuple(lora.targets)
    allowed = LORA_TARGETS + LORA_VISION_TARGETS
    if not targets or any(t not in allowed for t in targets) or len(set(targets)) != len(targets):
        raise ConfigError(f"config.model.lora.targets={targets!r}: distinct names among {', '.join(allowed)}")
    if lora.quantize_base not in LORA_QUANTIZE_BASE:
        raise ConfigError(f"config.model.lora.quantize_base={lora.quantize_base!r}; choose one of "
                          f"{', '.join(LORA_QUANTIZE_BASE)}")
    for index, pattern in enumerate(lora.trainable):
        try:
            re.compile(str(pattern))
        except re.error as error:
            raise ConfigError(f"config.model.lora.trainable[{index}]={pattern!r} is not a regex: {error}") from None
    if config.train.mode == "vflash":
        raise ConfigError("config.model.lora is not read with config.train.mode=vflash: the drafter trains whole, "
                          "and a LoRA-tuned target brings its adapters from config.model.target_from")


def _validate_paths(config: ml_collections.ConfigDict) -> None:
    """Data, tokenizer and base-model paths: no NUL or newline (a traceback, or a forged error line)."""
    def visit(where: str, value: Any) -> None:
        if isinstance(value, (list, tuple)):  # (path, weight) pairs of a mixture
            for item in value:
                visit(where, item)
            return
        try:
            check_path(where, value)
        except PathError as error:
            raise ConfigError(str(error)) from None

    for where in ("data.train", "data.eval", "data.tokenizer", "model.init_from", "model.target_from"):
        group, key = where.split(".")
        visit(f"config.{where}", config[group][key])


def _validate_optimisation(config: ml_collections.ConfigDict) -> None:
    train = config.train
    if train.decay not in DECAYS:
        raise ConfigError(f"config.train.decay={train.decay!r}; choose one of {', '.join(DECAYS)}")
    accum = int(train.grad_accum_steps)
    if accum < 1 or int(config.data.global_batch) % accum:
        raise ConfigError(f"config.train.grad_accum_steps={train.grad_accum_steps} must be ≥ 1 and divide "
                          f"config.data.global_batch={config.data.global_batch}")
    try:
        check_param_groups(list(train.param_groups))
    except ParamGroupError as error:
        raise ConfigError(str(error)) from None
    if not _finite("train.vision_lr_multiplier", train.vision_lr_multiplier) > 0:
        raise ConfigError(f"config.train.vision_lr_multiplier must be a finite number > 0 (freeze the tower with "
                          f"param_groups instead), got {train.vision_lr_multiplier!r}")
    # NaN passes every `<`/`>` comparison as False, so each bound is written as what must hold.
    for key, low, high, bounds in (("learning_rate", 0, math.inf, "> 0 (freeze with param_groups instead of 0)"),
                                   ("end_learning_rate_fraction", 0, 1, "in [0, 1]"),
                                   ("weight_decay", 0, math.inf, "≥ 0"),
                                   ("adam_b1", 0, 1, "in [0, 1)"), ("adam_b2", 0, 1, "in [0, 1)"),
                                   ("grad_clip_norm", 0, math.inf, "> 0")):
        value = _finite(f"train.{key}", train[key])
        strict_low = key in ("learning_rate", "grad_clip_norm")
        strict_high = key in ("adam_b1", "adam_b2")
        if not ((value > low if strict_low else value >= low) and (value < high if strict_high else value <= high)):
            raise ConfigError(f"config.train.{key} must be a finite number {bounds}, got {train[key]!r}")
    if not int(train.warmup_steps) >= 0:
        raise ConfigError(f"config.train.warmup_steps must be ≥ 0, got {train.warmup_steps!r}")
    if train.peak_flops is not None and not _finite("train.peak_flops", train.peak_flops) >= 0:
        raise ConfigError(f"config.train.peak_flops must be None/0 (from the device) or > 0, got {train.peak_flops}")
    for key in ("dtype", "param_dtype"):
        if config.model[key] not in DTYPES:
            raise ConfigError(f"config.model.{key}={config.model[key]!r}; choose one of {', '.join(DTYPES)}")
    if config.model.attention not in ATTENTION_IMPLEMENTATIONS:
        raise ConfigError(f"config.model.attention={config.model.attention!r}; choose one of "
                          f"{', '.join(ATTENTION_IMPLEMENTATIONS)}")
    if config.model.remat not in REMAT_POLICIES:
        raise ConfigError(f"config.model.remat={config.model.remat!r}; choose one of {', '.join(REMAT_POLICIES)}")
    lora = config.model.get("lora")
    frozen_base = lora is not None and not tuple(lora.trainable) and float(config.loss.weights.get("branches", 0)) == 0
    if config.model.param_dtype != "float32" and not frozen_base:
        # Adam's updates are ~1e-3 of a weight: below bf16's resolution they would round away. A LoRA base
        # (every parameter but the adapters, which stay f32) is frozen, so it may be held in bf16.
        raise ConfigError("config.model.param_dtype must be float32 (master weights) unless config.model.lora "
                          "freezes the base whole (no lora.trainable, no score head); "
                          "use config.model.dtype=bfloat16 for bf16 compute")


def check_param_groups(groups: Sequence) -> list[dict]:
    """config.train.param_groups as plain dicts with their regexes compiled; shape errors raised here (start-up,
    and again by `optim` when it builds the optimizer)."""
    checked = []
    for index, group in enumerate(groups):
        group = dict(group)
        where = f"config.train.param_groups[{index}]"
        unknown = set(group) - PARAM_GROUP_KEYS
        if unknown or "pattern" not in group:
            raise ParamGroupError(f"{where}: keys {sorted(group)}; a group has 'pattern' and one of "
                                  "'frozen': True or 'lr_multiplier': float")
        frozen = group.get("frozen", False)
        if not isinstance(frozen, bool):
            raise ParamGroupError(f"{where}.frozen must be a bool, got {frozen!r}")
        if frozen == ("lr_multiplier" in group):
            raise ParamGroupError(f"{where}: give exactly one of frozen=True or lr_multiplier")
        if not frozen and not float(group["lr_multiplier"]) > 0:
            raise ParamGroupError(f"{where}.lr_multiplier must be > 0 (freeze the group instead), "
                                  f"got {group['lr_multiplier']}")
        try:
            regex = re.compile(group["pattern"])
        except re.error as error:
            raise ParamGroupError(f"{where}.pattern {group['pattern']!r}: {error}") from None
        checked.append({"regex": regex, "frozen": frozen, "lr_multiplier": float(group.get("lr_multiplier", 1.0))})
    return checked


def _finite(path: str, value: Any) -> float:
    """`value` as a float; a non-number (a string, a bool), NaN or ±inf is one ConfigError naming the field."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ConfigError(f"config.{path} must be a finite number, got {value!r}")
    return float(value)


def _validate_loss(loss: ml_collections.ConfigDict) -> None:
    weights = dict(loss.weights)
    if set(weights) != set(OBJECTIVES):
        raise ConfigError(f"config.loss.weights must name exactly {', '.join(OBJECTIVES)}; "
                          f"got {', '.join(sorted(weights))}")
    for name, value in weights.items():
        if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
            raise ConfigError(f"config.loss.weights.{name} must be a finite number ≥ 0, got {value!r}")
    if not any(value > 0 for value in weights.values()):
        raise ConfigError("config.loss.weights: every weight is 0, nothing would be trained")
    if not (math.isfinite(float(loss.z_loss)) and float(loss.z_loss) >= 0):
        raise ConfigError(f"config.loss.z_loss must be ≥ 0, got {loss.z_loss}")
    if loss.loss_reduction not in LOSS_REDUCTIONS:
        raise ConfigError(f"config.loss.loss_reduction={loss.loss_reduction!r}; choose one of "
                          f"{', '.join(LOSS_REDUCTIONS)} (seed 000)")
    if not _finite("loss.coordinate_sigma", loss.coordinate_sigma) >= 0:
        raise ConfigError(f"config.loss.coordinate_sigma must be ≥ 0 (0: one-hot coordinate targets), "
                          f"got {loss.coordinate_sigma!r}")
    if loss.coordinate_sigma_final is not None:
        final = _finite("loss.coordinate_sigma_final", loss.coordinate_sigma_final)
        if not (final > 0 and float(loss.coordinate_sigma) > 0):
            raise ConfigError(f"config.loss.coordinate_sigma_final={loss.coordinate_sigma_final!r}: the width's "
                              f"geometric anneal needs both it and config.loss.coordinate_sigma "
                              f"({loss.coordinate_sigma!r}) > 0 (unset it for a constant width)")


def _validate_mode(config: ml_collections.ConfigDict) -> None:
    """train.mode against the keys it reads: an `ar` run never trains a drafter, a `vflash` run nothing else."""
    mode, weights = config.train.mode, dict(config.loss.weights)
    if mode not in TRAIN_MODES:
        # Another mode registered in valen_jax.tasks.modes reads its own keys; an unknown one is refused
        # there, before the run claims anything (train.run).
        return
    if mode == "ar":
        if weights["drafter"] > 0:
            raise ConfigError(f"config.loss.weights.drafter={weights['drafter']} needs config.train.mode=vflash "
                              "(the drafter trains against a frozen target: configs/vflash.py:drafter)")
        if config.model.target_from:
            raise ConfigError("config.model.target_from is read only with config.train.mode=vflash; unset it "
                              "for an ar run")
        return
    if not config.model.target_from:
        raise ConfigError("config.train.mode=vflash needs --config.model.target_from=WORKDIR, the ar run whose "
                          "latest checkpoint is the frozen target")
    if config.model.drafter is None:
        raise ConfigError("config.train.mode=vflash needs a config.model.drafter group (configs/vflash.py:drafter)")
    if config.model.init_from:
        raise ConfigError("config.train.mode=vflash takes the target from config.model.target_from; "
                          "config.model.init_from must be unset")
    if weights["drafter"] <= 0 or weights["tokens"] > 0 or weights["branches"] > 0:
        raise ConfigError(f"config.train.mode=vflash trains the drafter alone: config.loss.weights must be "
                          f"drafter > 0, tokens = branches = 0; got {weights}")
    if config.train.param_groups:
        raise ConfigError("config.train.param_groups are not read with config.train.mode=vflash (the target is "
                          "frozen whole and every drafter parameter trains)")
    if int(config.eval.every) > 0 or config.eval.at_end:
        # Evaluation reads the target's own predictions; the drafter's (acceptance length, speed-up) belong to
        # speculative decoding, which this mode does not run yet.
        raise ConfigError("config.train.mode=vflash evaluates nothing yet: set config.eval.every=0 and "
                          "config.eval.at_end=False (configs/vflash.py:drafter does)")
    drafter = config.model.drafter
    for key in ("block_size", "num_layers", "anchors_per_row"):
        if not (isinstance(drafter[key], int) and drafter[key] >= 1):
            raise ConfigError(f"config.model.drafter.{key} must be an integer ≥ 1, got {drafter[key]!r}")
    if not _finite("model.drafter.position_decay", drafter.position_decay) > 0:
        raise ConfigError(f"config.model.drafter.position_decay must be > 0, got {drafter.position_decay}")
    layers = tuple(drafter.target_layers)
    if any(not isinstance(i, int) or i < 0 for i in layers) or len(set(layers)) != len(layers):
        raise ConfigError(f"config.model.drafter.target_layers must be distinct layer indices ≥ 0, got {layers}")


def _validate_rl_keys(config: ml_collections.ConfigDict) -> None:
    """config.rl exactly when train.mode=reinforce reads it, with the schema's keys."""
    if config.train.mode == REINFORCE:
        if "rl" not in config:
            raise ConfigError("config.train.mode=reinforce needs a config.rl group (configs/reinforce.py)")
        _check_keys("rl", config.rl, tuple(_rl()))
    elif "rl" in config:
        raise ConfigError(f"config.rl is read only with config.train.mode=reinforce (this run: "
                          f"{config.train.mode!r}); remove it or set the mode")


def check_batch_split(config: ml_collections.ConfigDict, mesh) -> None:
    """Each micro-batch must split evenly over the batch-sharded devices (`data` × `fsdp`)."""
    devices = mesh.shape["data"] * mesh.shape["fsdp"]
    micro = int(config.data.global_batch) // int(config.train.grad_accum_steps)
    if micro % devices:
        raise ConfigError(f"config.data.global_batch={config.data.global_batch} / train.grad_accum_steps="
                          f"{config.train.grad_accum_steps} = {micro} rows per micro-batch do not split over "
                          f"{devices} batch-sharded devices (mesh data × fsdp)")

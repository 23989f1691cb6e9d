"""The config groups every task shares; each `configs/TASK.py` states only what differs.

    from configs import common
    config = common.base_config("chat", data=common.data_group(...), vision=True)
    return common.apply_variant(config, variant, "configs/chat.py")

Groups (validated once at start-up by `valen_jax.experiment.validate_config`): `data`,
`media_kwargs`, `model`, `train`, `loss`, `mesh`, `eval`. Variants after `:`: none = the CPU
smoke run; `tiny` = the smallest model and a few steps, for tests; `hf` = start from an HF
Qwen2/Qwen3/Llama checkpoint (`--config.model.init_from=PATH --config.data.tokenizer=PATH`).
"""

from __future__ import annotations

from pathlib import Path

import ml_collections

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE_KEYS = ("dim", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim", "rope_theta",
                     "tie_embeddings")


def data_group(fmt: str, train: str, eval_path: str, eval_format: str, *, seq_len: int, max_patches: int,
               global_batch: int = 16, train_options: dict | None = None,
               eval_options: dict | None = None) -> ml_collections.ConfigDict:
    data = ml_collections.ConfigDict()
    data.format = fmt
    data.train = str(ROOT / train)
    # Held-out data for evaluation during training (eval.every) and at the end (eval.at_end).
    data.eval = str(ROOT / eval_path)
    data.eval_format = eval_format
    # Converter options per set (data_pipeline.convert FORMATS), e.g. vakforge's {"split": "train"}.
    data.train_options = dict(train_options or {})
    data.eval_options = dict(eval_options or {})
    data.tokenizer = str(ROOT / "data/tokenizer")
    data.template_family = "chatml"
    data.seq_len = seq_len
    # Vision patches per row (before merging); 0 for text-only data.
    data.max_patches = max_patches
    data.global_batch = global_batch
    data.workers = 0
    data.shuffle = True
    # Packing several examples per row (segment ids keep them apart): "none", "first_fit" or
    # "best_fit"; at most max_segments per row; an example longer than a row is an "error" or a
    # counted "skip" (never truncated: a cut could split a media placeholder).
    data.packing = "none"
    data.max_segments = 16
    data.overlong = "error"
    data.pack_buffer = 32
    # Valen (seed 000): "question" (branch tree) or "shared_state"; row capacity in questions and
    # candidates. Unused by the token formats.
    data.valen_mode = "question"
    data.max_questions = 8
    data.max_candidates = 16
    return data


def media_group() -> ml_collections.ConfigDict:
    # Passed to the media processor and saved in the checkpoint (seed 000, "Images and video").
    media = ml_collections.ConfigDict()
    media.min_pixels = 32 * 32
    media.max_pixels = 64 * 64
    media.fps = 2.0
    media.max_frames = 8
    return media


def model_group(vision: bool) -> ml_collections.ConfigDict:
    model = ml_collections.ConfigDict()
    # An HF checkpoint (directory or hub name) to start from; its config.json fixes the architecture.
    model.init_from = ""
    model.dim = 128
    model.num_layers = 3
    model.num_heads = 4
    model.num_kv_heads = 2
    model.head_dim = 32
    model.mlp_dim = 384
    model.rope_theta = 10000.0
    model.tie_embeddings = True
    # Compute dtype; parameters (and so Adam's updates) stay float32 master weights.
    model.dtype = "float32"
    model.param_dtype = "float32"
    model.remat = False
    model.scan_layers = False
    if not vision:
        model.vision = None
    else:
        model.vision = ml_collections.ConfigDict()
        model.vision.patch_size = 8
        model.vision.merge_size = 2
        model.vision.temporal_patch_size = 2
        model.vision.dim = 96
        model.vision.num_layers = 2
        model.vision.num_heads = 4
        model.vision.mlp_dim = 256
    return model


def train_group() -> ml_collections.ConfigDict:
    train = ml_collections.ConfigDict()
    train.steps = 160
    train.checkpoint_every = 80
    train.keep_checkpoints = 3
    # zstd on state arrays: f32 weights and moments shrink ~7% for 2-3x the writer's CPU time.
    train.checkpoint_compression = False
    train.seed = 0
    train.log_every = 20
    train.learning_rate = 3e-3
    train.warmup_steps = 20
    train.decay = "cosine"  # after warmup: "cosine" or "linear" down to end_learning_rate_fraction
    train.end_learning_rate_fraction = 0.05
    train.weight_decay = 0.01
    train.adam_b1 = 0.9
    train.adam_b2 = 0.95
    train.grad_clip_norm = 1.0
    # Micro-batches per step, accumulated inside the compiled step: same update as one batch.
    train.grad_accum_steps = 1
    # [{"pattern": REGEX over the '/'-joined param path, "frozen": True | "lr_multiplier": x}], first match wins.
    train.param_groups = []
    # Peak FLOP/s per device for MFU; None: from the device kind's datasheet, measured on CPU.
    train.peak_flops = ml_collections.config_dict.placeholder(float)
    # Test hook only: hold every checkpoint's background write open this long (fault tests).
    train.debug_pause_in_save_s = 0.0
    return train


def loss_group(weights: dict[str, float]) -> ml_collections.ConfigDict:
    loss = ml_collections.ConfigDict()
    # Every objective named explicitly; one a batch cannot provide must weigh 0.
    loss.weights = dict(weights)
    # PaLM's z-loss coefficient on log(Z)² of the token softmax; 0 = off (1e-4 is the usual value).
    loss.z_loss = 0.0
    # Valen's loss_reduction (seed 000): "state_mean" averages questions within a state, then states.
    loss.loss_reduction = "state_mean"
    return loss


def mesh_group() -> ml_collections.ConfigDict:
    # -1 means "the rest of the devices".
    mesh = ml_collections.ConfigDict()
    mesh.data = -1
    mesh.fsdp = 1
    mesh.tensor = 1
    return mesh


def eval_group() -> ml_collections.ConfigDict:
    evaluation = ml_collections.ConfigDict()
    evaluation.at_end = True
    # Teacher-forced loss/accuracy on data.eval every this many steps (eval_* in metrics.jsonl); 0 = off.
    evaluation.every = 80
    evaluation.batch_size = 16
    evaluation.max_examples = 32
    evaluation.max_new_tokens = 64
    return evaluation


TOKENS_ONLY = {"tokens": 1.0, "branches": 0.0, "drafter": 0.0}


def base_config(task: str, data: ml_collections.ConfigDict, vision: bool,
                loss_weights: dict[str, float] = TOKENS_ONLY) -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.task = task
    config.data = data
    config.media_kwargs = media_group()
    config.model = model_group(vision)
    config.train = train_group()
    config.loss = loss_group(loss_weights)
    config.mesh = mesh_group()
    config.eval = eval_group()
    return config


def apply_variant(config: ml_collections.ConfigDict, variant: str, name: str) -> ml_collections.ConfigDict:
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
        # The decoder comes from the checkpoint; a vision tower, if any, starts fresh.
        for key in ARCHITECTURE_KEYS:
            config.model[key] = None
        config.model.init_from = ml_collections.config_dict.placeholder(str)
        config.model.dtype = "bfloat16"
        config.model.remat = True
        config.model.scan_layers = True
        config.train.learning_rate = 2e-5
        config.train.steps = 1000
        config.train.checkpoint_every = 200
        config.eval.every = 200
    elif variant:
        raise ValueError(f"{name}: unknown variant {variant!r}; known: tiny, hf")
    return config

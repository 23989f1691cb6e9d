"""VFlash training config (seed 004): primitives answered autoregressively (`ar` mode).

    python -m valen_jax.train --config=configs/vflash.py --workdir=runs/vflash-smoke
    python -m valen_jax.train --config=configs/vflash.py:tiny --workdir=/tmp/t --config.train.steps=4

Variants after `:`: none = the CPU smoke run on `data/smoke/vflash`; `tiny` = the smallest
model and a few steps, for tests.
"""

from pathlib import Path

import ml_collections

ROOT = Path(__file__).resolve().parent.parent


def get_config(variant: str = "") -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.task = "vflash"

    config.data = ml_collections.ConfigDict()
    config.data.format = "recipe"
    config.data.train = str(ROOT / "data/smoke/vflash/recipe.json")
    config.data.eval = str(ROOT / "data/smoke/vflash/eval.jsonl")
    config.data.tokenizer = str(ROOT / "data/tokenizer")
    config.data.template_family = "chatml"
    config.data.seq_len = 192
    # Vision patches per row (before merging): 2 images of 8×8 patches fit.
    config.data.max_patches = 128
    config.data.global_batch = 16
    config.data.workers = 0
    config.data.shuffle = True

    # Passed to the media processor and saved in the checkpoint (seed 000, "Images and video").
    config.media_kwargs = ml_collections.ConfigDict()
    config.media_kwargs.min_pixels = 32 * 32
    config.media_kwargs.max_pixels = 64 * 64
    config.media_kwargs.fps = 2.0
    config.media_kwargs.max_frames = 8

    config.model = ml_collections.ConfigDict()
    # An HF checkpoint (directory or hub name) to start from; its config.json fixes the architecture.
    config.model.init_from = ""
    config.model.dim = 128
    config.model.num_layers = 3
    config.model.num_heads = 4
    config.model.num_kv_heads = 2
    config.model.head_dim = 32
    config.model.mlp_dim = 384
    config.model.rope_theta = 10000.0
    config.model.tie_embeddings = True
    config.model.dtype = "float32"
    config.model.param_dtype = "float32"
    config.model.remat = False
    config.model.scan_layers = False
    config.model.vision = ml_collections.ConfigDict()
    config.model.vision.patch_size = 8
    config.model.vision.merge_size = 2
    config.model.vision.temporal_patch_size = 2
    config.model.vision.dim = 96
    config.model.vision.num_layers = 2
    config.model.vision.num_heads = 4
    config.model.vision.mlp_dim = 256

    config.train = ml_collections.ConfigDict()
    config.train.steps = 160
    config.train.checkpoint_every = 80
    config.train.keep_checkpoints = 3
    config.train.seed = 0
    config.train.log_every = 20
    config.train.learning_rate = 3e-3
    config.train.warmup_steps = 20
    config.train.end_learning_rate_fraction = 0.05
    config.train.weight_decay = 0.01
    config.train.adam_b1 = 0.9
    config.train.adam_b2 = 0.95
    config.train.grad_clip_norm = 1.0

    # -1 means "the rest of the devices".
    config.mesh = ml_collections.ConfigDict()
    config.mesh.data = -1
    config.mesh.fsdp = 1
    config.mesh.tensor = 1

    config.eval = ml_collections.ConfigDict()
    config.eval.at_end = True
    config.eval.batch_size = 16
    config.eval.max_examples = 32
    config.eval.max_new_tokens = 64

    if variant == "tiny":
        config.model.dim = 64
        config.model.num_layers = 2
        config.model.head_dim = 16
        config.model.mlp_dim = 128
        config.model.vision.dim = 32
        config.model.vision.num_layers = 1
        config.model.vision.mlp_dim = 64
        config.data.global_batch = 8
        config.train.steps = 6
        config.train.checkpoint_every = 3
        config.train.log_every = 1
        config.train.warmup_steps = 2
        config.eval.max_examples = 8
        config.eval.max_new_tokens = 16
    elif variant == "hf":
        # Start the decoder from an HF Qwen2/Qwen3/Llama checkpoint; the vision tower starts fresh:
        #   --config=configs/vflash.py:hf --config.model.init_from=PATH --config.data.tokenizer=PATH
        for key in ("dim", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim", "rope_theta",
                    "tie_embeddings"):
            config.model[key] = None
        config.model.init_from = ml_collections.config_dict.placeholder(str)
        config.model.dtype = "bfloat16"
        config.model.remat = True
        config.model.scan_layers = True
        config.train.learning_rate = 2e-5
        config.train.steps = 1000
    elif variant:
        raise ValueError(f"configs/vflash.py: unknown variant {variant!r}; known: tiny, hf")
    return config

"""The decoder-only language model, optionally fed vision tokens in its media slots."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from valen_jax.models import kv_cache, sharding
from valen_jax.models.config import ModelConfig, dtype_of
from valen_jax.models.heads import ScoreHead
from valen_jax.models.layers import Block, RMSNorm, param
from valen_jax.models.qwen_vision import QwenVisionEncoder
from valen_jax.models.remat import checkpoint_policy
from valen_jax.models.sharding import constrain
from valen_jax.models.vision import VisionEncoder

_TOWER_STREAM = 0x766973  # "vis": the vision tower's adapter-dropout stream within a step's key


def _block(cfg: ModelConfig, rngs: nnx.Rngs) -> Block:
    return Block(cfg.dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim, bias=cfg.attention_bias,
                 rope_theta=cfg.rope_theta, eps=cfg.norm_eps, dtype=dtype_of(cfg.dtype),
                 param_dtype=dtype_of(cfg.param_dtype), rngs=rngs, qk_norm=cfg.qk_norm,
                 rope_scaling=cfg.rope_scaling, mrope_section=cfg.mrope_section,
                 mrope_interleaved=cfg.mrope_interleaved, attention=cfg.attention, lora=cfg.lora)


def _vision(cfg: ModelConfig, rngs: nnx.Rngs):
    # The tower's adapters are those of config.model.lora's `vision/` targets (none: it has none).
    if cfg.vision.family in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        return QwenVisionEncoder(cfg.vision, cfg.dim, cfg.dtype, cfg.param_dtype, rngs, attention=cfg.attention,
                                 lora=cfg.lora)
    return VisionEncoder(cfg.vision, cfg.dim, cfg.dtype, cfg.param_dtype, rngs, attention=cfg.attention, lora=cfg.lora)


def _stacked_blocks(cfg: ModelConfig, rngs: nnx.Rngs) -> Block:
    """All layers as one Block whose parameters carry a leading `layers` axis, for nnx.scan."""

    @nnx.split_rngs(splits=cfg.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=cfg.num_layers)
    def create(layer_rngs):
        return _block(cfg, layer_rngs)

    stacked = create(rngs)
    for _, variable in nnx.iter_graph(stacked):
        if isinstance(variable, nnx.Variable) and variable.has_metadata("logical_axes"):
            variable.set_metadata("logical_axes", ("layers", *variable.get_metadata()["logical_axes"]))
    return stacked


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        pdt, cdt = dtype_of(cfg.param_dtype), dtype_of(cfg.dtype)
        self.cfg = cfg
        self.dtype = cdt
        self.embed = param(rngs, (cfg.vocab_size, cfg.dim), ("vocab", "embed"), pdt)
        if cfg.scan_layers:
            self.layers = _stacked_blocks(cfg, rngs)
        else:
            self.layers = nnx.List([_block(cfg, rngs) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.dim, cfg.norm_eps, pdt, rngs)
        if not cfg.tie_embeddings:
            self.lm_head = param(rngs, (cfg.dim, cfg.vocab_size), ("embed", "vocab"), pdt)
        self.vision = _vision(cfg, rngs) if cfg.vision else None
        if cfg.vision and cfg.vision.deepstack_layers and cfg.scan_layers:
            raise ValueError("deepstack vision features (Qwen3-VL) are added between decoder layers; "
                             "scan_layers=True is not implemented for them")
        self.score_head = ScoreHead(cfg.dim, pdt, rngs) if cfg.score_head else None

    def _run_layers(self, x, positions, ids, deepstack=(), lora_key=None):
        """`ids`: (segment_ids, branch_ids or None), from which each layer's attention builds its mask.
        `deepstack`: [B, T, D] additions after layers 0, 1, ... (Qwen3-VL; zero outside media slots).
        `lora_key`: a training step's key, split into one per layer (the same split scanned or not)."""
        keys = None if lora_key is None else jax.random.split(lora_key, self.cfg.num_layers)

        def run(block, h, key):
            return block(h, positions, *ids, lora_key=key)

        if self.cfg.remat != "none":  # models/remat.py: what each layer keeps for the backward
            run = nnx.remat(run, policy=checkpoint_policy(self.cfg.remat))
        if not self.cfg.scan_layers:
            for i, layer in enumerate(self.layers):
                x = run(layer, x, None if keys is None else keys[i])
                if i < len(deepstack):
                    x = x + deepstack[i]
            return x

        if keys is None:
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def scan(h, block):
                return run(block, h, None)

            return scan(x, self.layers)

        @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=nnx.Carry)
        def scan_with_keys(h, block, key):
            return run(block, h, key)

        return scan_with_keys(x, self.layers, keys)

    def embed_tokens(self, tokens, vision_inputs=None):
        """Token embeddings, with media slots filled by vision tokens.

        vision_inputs: (patches [B, P, patch_dim], patch positions [B, P, 3], patch segments [B, P]).
        The k-th media-slot token of a row (image_pad_id, or video_pad_id when set) takes the row's
        k-th merged vision token, in order.
        """
        return self._embed(tokens, vision_inputs)[0]

    def _embed(self, tokens, vision_inputs, lora_key=None):
        """(embeddings, deepstack additions: a list of [B, T, D], empty unless the tower is Qwen3-VL's).
        `lora_key`: a training step's key; the tower's adapters draw their dropout from its own stream."""
        # Gather rows from a table whole along `embed`: an fsdp-split lookup would need a
        # full rematerialisation to reach the batch-sharded activation layout.
        table = constrain(self.embed[...], ("act_vocab", None))
        x = jnp.take(table, tokens, axis=0).astype(self.dtype)
        if self.vision is None or vision_inputs is None or vision_inputs[0].shape[1] == 0:
            return x, []
        # fold_in, not one more split: the decoder's per-layer keys (`_run_layers`) stay what they were.
        tower_key = None if lora_key is None else jax.random.fold_in(lora_key, _TOWER_STREAM)
        features = self.vision(*vision_inputs, lora_key=tower_key)
        deep = []
        if isinstance(features, tuple):
            features, deep = features
        is_slot = tokens == self.cfg.image_pad_id
        if self.cfg.video_pad_id >= 0:
            is_slot |= tokens == self.cfg.video_pad_id
        index = jnp.clip(jnp.cumsum(is_slot, axis=1) - 1, 0, features.shape[1] - 1)

        def place(merged, fill):
            # Keep vision tokens batch-sharded like the text so the gather stays local.
            merged = constrain(merged.astype(self.dtype), ("batch", None, "act_embed"))
            return jnp.where(is_slot[..., None], jnp.take_along_axis(merged, index[..., None], axis=1), fill)

        return place(features, x), [place(d, jnp.zeros((), self.dtype)) for d in deep]

    def _check_positions(self, positions, vision_inputs):
        has_media = vision_inputs is not None and vision_inputs[0].shape[1] > 0
        if self.cfg.mrope_section is not None and has_media and positions.ndim != 3:
            # 1-D positions would give media tokens text positions: a different model, silently.
            raise ValueError(f"an M-RoPE model fed media needs positions [B, T, 3] (models.mrope.rope_index), "
                             f"got shape {positions.shape}")

    def hidden(self, tokens, positions, segment_ids, vision_inputs=None, branch_ids=None, lora_key=None):
        """Final-norm hidden states [B, T, D] (what heads read). `lora_key`: a training step's key, which turns
        on the adapters' dropout (config.model.lora.dropout); evaluation and decoding pass none."""
        self._check_positions(positions, vision_inputs)
        x, deepstack = self._embed(tokens, vision_inputs, lora_key)
        x = constrain(x, ("batch", "length", "act_embed"))
        x = self._run_layers(x, positions, (segment_ids, branch_ids), deepstack, lora_key)
        return self.final_norm(x)

    def head_matrix(self):
        """The [D, V] output projection in the compute dtype (the embedding's transpose when tied)."""
        head = self.embed[...].T if self.cfg.tie_embeddings else self.lm_head[...]
        return head.astype(self.dtype)

    def logits(self, hidden):
        logits = jnp.einsum("btd,dv->btv", hidden, self.head_matrix(), preferred_element_type=jnp.float32)
        return constrain(logits, ("batch", "length", "act_vocab"))

    def __call__(self, tokens, positions, segment_ids, vision_inputs=None, branch_ids=None):
        """tokens, positions, segment_ids: int32 [B, T] (positions [B, T, 3] with M-RoPE); vision_inputs as in `embed_tokens` → f32 logits [B, T, V]."""
        return self.logits(self.hidden(tokens, positions, segment_ids, vision_inputs, branch_ids))


    def prefill(self, tokens, positions, lengths, cache_length: int, vision_inputs=None, collect=()):
        """Run right-padded prompts once and keep their keys and values for decoding.

        tokens int32 [B, P] (row b's prompt in [0, lengths[b]), then padding); positions [B, P] or [B, P, 3];
        vision_inputs as in `embed_tokens` (media enter here only: generated tokens are text). Returns the
        f32 logits [B, V] at each row's last prompt token and a `kv_cache.KVCache` of `cache_length` slots.
        Padding is segment 0, so real tokens never attend it (`attention.attend`).
        collect: layer indices (a block drafter's `target_layers`); when given, a third result holds those
        layers' outputs at every prompt slot, concatenated: [B, P, k·D] (`drafter.target_features`).
        """
        self._check_positions(positions, vision_inputs)
        segment_ids = (jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]).astype(jnp.int32)
        x, deepstack = self._embed(tokens, vision_inputs)
        x = constrain(x, ("batch", "length", "act_embed"))
        self._check_collect(collect, deepstack)
        if self.cfg.scan_layers:
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
            def scan(h, block):
                h, k, v = block.prefill(h, positions, segment_ids)
                # Every layer's output is stacked only when asked (a drafter's features).
                return h, ((k, v, h) if collect else (k, v))

            x, per_layer = scan(x, self.layers)
            keys, values = per_layer[0], per_layer[1]
            outputs = per_layer[2] if collect else None
        else:
            keys, values, outputs = [], [], {}
            for i, layer in enumerate(self.layers):
                x, k, v = layer.prefill(x, positions, segment_ids)
                keys.append(k)
                values.append(v)
                if i in collect:
                    outputs[i] = x
                if i < len(deepstack):
                    x = x + deepstack[i]
            keys, values = jnp.stack(keys), jnp.stack(values)
        last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)  # [B, 1, D]
        logits = self.logits(self.final_norm(last))[:, 0]
        cache = kv_cache.from_prefill(keys, values, cache_length)
        if not collect:
            return logits, cache
        return logits, cache, jnp.concatenate([outputs[i] for i in collect], axis=-1)

    def _check_collect(self, collect, deepstack=()):
        if collect and (deepstack or (self.cfg.vision is not None and self.cfg.vision.deepstack_layers)):
            # Same refusal as drafter.target_features: deepstack features enter between layers.
            raise NotImplementedError("drafter features of a deepstack (Qwen3-VL) target are not implemented")
        if collect and not all(0 <= i < self.cfg.num_layers for i in collect):
            raise ValueError(f"collect={tuple(collect)}: the decoder has layers 0..{self.cfg.num_layers - 1}")

    def _cached_layers(self, method: str, x, positions, cache: kv_cache.KVCache, cursor, collect=()):
        """x through every layer's cached path (`Block.decode` or `Block.extend`), each layer writing its
        keys/values into `cache` at the rows' cursors → (x, cache, the `collect` layers' outputs
        concatenated [B, T, k·D] or None)."""
        self._check_collect(collect)
        if not self.cfg.scan_layers:
            outputs = {}
            for i, layer in enumerate(self.layers):
                x, cache = getattr(layer, method)(x, positions, cache, i, cursor)
                if i in collect:
                    outputs[i] = x
            features = jnp.concatenate([outputs[i] for i in collect], axis=-1) if collect else None
            return x, cache, features
        # The cache rides in the carry (updated in place); the layer index picks each block's slice.
        # A plain lax.scan over the split layers: decode steps run inside a while_loop, and nnx.scan
        # refuses modules made at an outer trace level.
        block_def, block_state = nnx.split(self.layers)

        def step(carry, layer_and_state):
            layer, state = layer_and_state
            h, c = carry
            h, c = getattr(nnx.merge(block_def, state), method)(h, positions, c, layer, cursor)
            return (h, c), (h if collect else None)  # every layer's output only when a drafter asks

        (x, cache), every = jax.lax.scan(step, (x, cache), (jnp.arange(self.cfg.num_layers), block_state))
        features = jnp.concatenate([every[i] for i in collect], axis=-1) if collect else None
        return x, cache, features

    def decode_step(self, tokens, positions, cache: kv_cache.KVCache, cursor, collect=()):
        """One token per row: tokens int32 [B] at cache slot cursor[b] with positions [B] (or [B, 3]) →
        (f32 logits [B, V] for the token after it, the cache with its keys and values written). With
        `collect` (layer indices) a third result: those layers' outputs [B, 1, k·D] (as `prefill`)."""
        x = constrain(self._embed(tokens[:, None], None)[0], ("batch", "length", "act_embed"))  # [B, 1, D]
        x, cache, features = self._cached_layers("decode", x, positions[:, None], cache, cursor, collect)
        logits = self.logits(self.final_norm(x))[:, 0]
        return (logits, cache, features) if collect else (logits, cache)

    def extend(self, tokens, positions, cache: kv_cache.KVCache, cursor, collect=()):
        """T tokens per row (speculative verification): tokens int32 [B, T] at slots cursor[b] ..
        cursor[b] + T - 1 with positions [B, T] → (f32 logits [B, T, V], logit t for the token after
        tokens[:, t]; the cache with their keys/values). Causal within the block, the cache below. The
        caller keeps cursor + T <= the cache length (a scatter drops writes past it, it does not fail).
        With `collect` (layer indices) a third result: those layers' outputs [B, T, k·D] (as `prefill`)."""
        x = constrain(self._embed(tokens, None)[0], ("batch", "length", "act_embed"))
        x, cache, features = self._cached_layers("extend", x, positions, cache, cursor, collect)
        logits = self.logits(self.final_norm(x))
        return (logits, cache, features) if collect else (logits, cache)


def abstract_model(cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """Shapes and metadata only: nothing is allocated (used to derive shardings first)."""
    model = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))
    return nnx.split(model)


def init_params(cfg: ModelConfig, seed: int, shardings) -> dict:
    """Initialise directly into the given shardings; no device ever holds the whole model."""

    def create():
        return nnx.to_pure_dict(nnx.split(Transformer(cfg, nnx.Rngs(seed)))[1])

    return jax.jit(create, out_shardings=shardings)()


class PerLayer:
    """The same weights in the unscanned layout: a `scan_layers` model's stacked decoder leaves [L, ...] split
    into one subtree per layer (adapters and quantised leaves alike), each laid out on `mesh` as the unscanned
    model's logical axes say. Everything outside `layers` is kept as is. Built once per (config, mesh), so a
    run that splits again and again (a reinforcement run's rollouts, from the params of the moment) compiles
    the split once: `split = PerLayer(cfg, mesh); split(params)` decodes with `split.graphdef`.

    Why decoding wants this: a step that reads layer i of a stacked weight slices it first. On an H200 (the
    Qwen2.5-1.5B shape in bf16, the engine's compiled loop) the stacked layout decoded 244 tokens/s at batch 1
    and 2242 at batch 8, the same model unscanned 507 and 4353, and fully unrolling the loop over the stacked
    weights (static slices) gave 254 and 2535: the slices are copied before the matmuls, not read in place.
    For a v5e the compile tool counts 1.74e11 bytes in the stacked generate program against 1.18e11.
    Peak memory while splitting: the decoder's weights twice (the stacked arrays are freed when the caller
    drops them; a split from a training state's params lives until the caller drops it)."""

    def __init__(self, cfg: ModelConfig, mesh):
        self.cfg = dataclasses.replace(cfg, scan_layers=False)
        self.graphdef, abstract = abstract_model(self.cfg)
        wanted = nnx.to_pure_dict(abstract)["layers"]
        self._expected = jax.tree.map(lambda leaf: (cfg.num_layers, *leaf.shape), wanted[0])
        layer = nnx.to_pure_dict(sharding.state_shardings(abstract, mesh))["layers"][0]
        # i is traced: one program for every layer.
        self._take = jax.jit(lambda tree, i: jax.tree.map(
            lambda leaf: jax.lax.dynamic_index_in_dim(leaf, i, keepdims=False), tree), out_shardings=layer)

    def __call__(self, params: dict) -> dict:
        stacked = params["layers"]
        found = jax.tree.map(lambda leaf: tuple(leaf.shape), stacked)
        if self._expected != found:
            raise ValueError(f"per_layer: the stacked decoder leaves {found} are not {self.cfg.num_layers} "
                             f"layers of the unscanned model's {self._expected}")
        return {**params, "layers": {i: self._take(stacked, i) for i in range(self.cfg.num_layers)}}


def per_layer(cfg: ModelConfig, params: dict, mesh) -> tuple[ModelConfig, nnx.GraphDef, dict]:
    """`PerLayer(cfg, mesh)` applied once → (the unscanned config, its graphdef, the split params)."""
    split = PerLayer(cfg, mesh)
    return split.cfg, split.graphdef, split(params)

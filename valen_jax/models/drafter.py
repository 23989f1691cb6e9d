"""VFlash's block drafter (seed 004, issue 16): proposes a whole primitive block in one forward pass.

Choice: a DFlash-style block drafter (block diffusion drafting, arXiv 2602.06036; SpecForge's training
wrapper, vllm-project/tpu-inference's NNX drafter), over EAGLE-3 and Medusa:
- An `atomic_decoding` call announces a fixed-size block of 18–100 highly regular tokens. DFlash drafts
  a block of B tokens in ONE pass (all mask slots attend to each other), so drafting costs one small
  forward per block whatever B; EAGLE-3 drafts autoregressively (B drafter passes per block) and
  Medusa's independent heads see neither each other nor the earlier draft tokens.
- It reads the target's own hidden states: k target layers' outputs are fused (concatenated, projected
  to the width, normed) and injected as extra keys/values in every drafter layer, so one or two
  drafter layers suffice (the target has already done the understanding, image included).
- It reuses the target's frozen embedding and output head: no new vocabulary, and a drafted token is
  exactly a token the target can verify.

Layout of one block (B = `block_size`): slots [anchor, mask_1, …, mask_B] at positions p, p+1, …, p+B,
where the anchor is the last committed token x_p (embedded by the target's table) and each mask slot
holds one learned mask embedding. Mask slot k predicts x_{p+k}. Slots attend bidirectionally within
their block and to the fused target features of the context positions t < p of the same segment: at
decoding time the target has hidden states for every token before the anchor (the anchor itself is
the token it has just emitted). DFlash puts the anchor in slot 0 too and predicts its own token at
each mask slot; we give the block B + 1 slots so a pass proposes B tokens. The drafter has its own
1-D rotary positions (an M-RoPE target's text coordinates, axis 0).

Training (`valen_jax.vflash.objective.make_drafter_train_step`) runs many blocks per row at once: `anchors`
[rows, A] positions; each block sees the whole row's context through its mask. Decoding
(`valen_jax.decoding.speculative`) caches each layer's projected context keys/values once per token
(`context_cache`, `write_context`) and drafts one block against them (`draft_cached`): the same math.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from valen_jax.models import kv_cache
from valen_jax.models.config import ModelConfig, dtype_of
from valen_jax.models.layers import RMSNorm, SwiGLU, dense, param, rope
from valen_jax.models.transformer import Transformer

# DFlash fuses 5 target layers; a shallower target gives each of its layers.
DEFAULT_FUSED_LAYERS = 5


@dataclass(frozen=True)
class DrafterConfig:
    """The drafter's shape: width, heads and rotary base are the target's (its features and head fit)."""

    block_size: int
    num_layers: int
    target_layers: tuple[int, ...]
    dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    dtype: str = "float32"
    param_dtype: str = "float32"

    @classmethod
    def of(cls, group, target: ModelConfig) -> DrafterConfig:
        """From `config.model.drafter` and the target's ModelConfig; target layers checked against its depth."""
        layers = tuple(int(i) for i in group.target_layers) or default_target_layers(target.num_layers)
        if max(layers) >= target.num_layers:
            raise ValueError(f"config.model.drafter.target_layers={layers}: the target has {target.num_layers} "
                             f"layers (0…{target.num_layers - 1})")
        return cls(block_size=int(group.block_size), num_layers=int(group.num_layers), target_layers=layers,
                   dim=target.dim, num_heads=target.num_heads, num_kv_heads=target.num_kv_heads,
                   head_dim=target.head_dim, mlp_dim=target.mlp_dim, rope_theta=target.rope_theta,
                   norm_eps=target.norm_eps, dtype=target.dtype, param_dtype=target.param_dtype)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DrafterConfig:
        return cls(**{**data, "target_layers": tuple(data["target_layers"])})


def default_target_layers(num_layers: int, count: int = DEFAULT_FUSED_LAYERS) -> tuple[int, ...]:
    """Up to `count` layers spread evenly from the first to the last (shallow, middle and deep features)."""
    count = min(count, num_layers)
    if count == 1:
        return (num_layers - 1,)
    return tuple(sorted({round(i * (num_layers - 1) / (count - 1)) for i in range(count)}))


def target_features(target: Transformer, layers: tuple[int, ...], tokens, positions, segment_ids,
                    vision_inputs=None):
    """The outputs of the target's `layers` (before the final norm), concatenated: [B, T, k·D].

    Runs the target's embedding and blocks through their public calls (the decoder exposes no
    intermediate states); the caller stops gradients (the target is frozen).
    """
    cfg = target.cfg
    if cfg.vision is not None and cfg.vision.deepstack_layers:
        raise NotImplementedError("a drafter for a deepstack (Qwen3-VL) target is not implemented: its vision "
                                  "features enter between decoder layers")
    x = target.embed_tokens(tokens, vision_inputs)
    wanted = set(layers)
    if not cfg.scan_layers:
        outputs = {}
        for i, block in enumerate(target.layers):
            x = block(x, positions, segment_ids)
            if i in wanted:
                outputs[i] = x
            if len(outputs) == len(wanted):
                break
        return jnp.concatenate([outputs[i] for i in layers], axis=-1)
    graphdef, stacked = nnx.split(target.layers)

    def one(h, layer_state):
        h = nnx.merge(graphdef, layer_state)(h, positions, segment_ids)
        return h, h

    _, every = jax.lax.scan(one, x, stacked)  # [L, B, T, D]; a forward pass only, so the stack is cheap
    return jnp.concatenate([every[i] for i in layers], axis=-1)


def text_positions(positions):
    """1-D positions [B, T]: an M-RoPE row's [B, T, 3] gives its temporal axis (text tokens: all three equal)."""
    return positions[..., 0] if positions.ndim == 3 else positions


class DrafterLayer(nnx.Module):
    """Pre-norm block whose attention reads the block's own slots and the injected context."""

    def __init__(self, cfg: DrafterConfig, rngs: nnx.Rngs):
        pdt = dtype_of(cfg.param_dtype)
        self.cfg = cfg
        self.dtype = dtype_of(cfg.dtype)
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps, pdt, rngs)
        self.q = param(rngs, (cfg.dim, cfg.num_heads, cfg.head_dim), ("embed", "heads", "head_dim"), pdt)
        self.k = param(rngs, (cfg.dim, cfg.num_kv_heads, cfg.head_dim), ("embed", "kv_heads", "head_dim"), pdt)
        self.v = param(rngs, (cfg.dim, cfg.num_kv_heads, cfg.head_dim), ("embed", "kv_heads", "head_dim"), pdt)
        self.o = param(rngs, (cfg.num_heads, cfg.head_dim, cfg.dim), ("heads", "head_dim", "embed"), pdt)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps, pdt, rngs)
        self.mlp = SwiGLU(cfg.dim, cfg.mlp_dim, self.dtype, pdt, rngs)

    def _project(self, x, positions, weight, rotate: bool):
        """x [B, L, D] → [B, L, heads, H], rotated by `positions` [B, L]."""
        y = dense(x.astype(self.dtype), weight[...].astype(self.dtype))
        return rope(y, positions, self.cfg.rope_theta) if rotate else y

    def __call__(self, slots, slot_positions, context, context_positions, context_mask):
        """slots [B, A, S, D]; slot_positions [B, A, S]; context [B, T, D] (fused features, normed);
        context_positions [B, T]; context_mask bool [B, A, T] (which context positions each block sees)."""
        batch, blocks, size, dim = slots.shape
        kv, groups = self.cfg.num_kv_heads, self.cfg.num_heads // self.cfg.num_kv_heads
        flat = self.attn_norm(slots).reshape(batch, blocks * size, dim)
        flat_positions = slot_positions.reshape(batch, blocks * size)
        q = self._project(flat, flat_positions, self.q, True)
        q = q.reshape(batch, blocks, size, kv, groups, self.cfg.head_dim)
        block_k = self._project(flat, flat_positions, self.k, True).reshape(batch, blocks, size, kv, -1)
        block_v = self._project(flat, flat_positions, self.v, False).reshape(batch, blocks, size, kv, -1)
        # The context's keys/values are the same for every block of a row: projected once.
        context_k = self._project(context, context_positions, self.k, True)
        context_v = self._project(context, context_positions, self.v, False)
        scale = self.cfg.head_dim ** -0.5
        to_context = jnp.einsum("baskgh,btkh->baskgt", q, context_k, preferred_element_type=jnp.float32) * scale
        to_block = jnp.einsum("baskgh,barkh->baskgr", q, block_k, preferred_element_type=jnp.float32) * scale
        to_context = jnp.where(context_mask[:, :, None, None, None, :], to_context, -jnp.inf)
        # Softmax over context and block keys together; the block's own keys are never masked, so a
        # block with no context (an anchor at a segment's start) still has a finite normaliser.
        probs = jax.nn.softmax(jnp.concatenate([to_context, to_block], axis=-1), axis=-1).astype(self.dtype)
        length = context.shape[1]
        out = (jnp.einsum("baskgt,btkh->baskgh", probs[..., :length], context_v)
               + jnp.einsum("baskgr,barkh->baskgh", probs[..., length:], block_v))
        out = out.reshape(batch, blocks * size, self.cfg.num_heads, self.cfg.head_dim)
        attended = dense(out, self.o[...].astype(self.dtype), in_dims=2).reshape(slots.shape)
        slots = slots + attended.astype(slots.dtype)
        return slots + self.mlp(self.mlp_norm(slots)).astype(slots.dtype)

    # -- decoding: the context's keys/values cached once per token (decoding.draft_rules) --------------

    def context_keys_values(self, context, context_positions):
        """The context's keys (rotated at their own positions) and values [B, T, K, H], exactly as
        `__call__` projects them: what a decoding cache keeps so a pass never re-projects the context."""
        return (self._project(context, context_positions, self.k, True),
                self._project(context, context_positions, self.v, False))

    def cached(self, slots, slot_positions, keys, values, visible):
        """One block per row against cached context keys/values: `__call__` with one block, the same
        products in the same order. slots [B, S, D]; slot_positions [B, S]; keys, values [B, K, C, H]
        (`kv_cache` layout); visible bool [B, C] (the context slots the block sees)."""
        batch, size, dim = slots.shape
        kv, groups = self.cfg.num_kv_heads, self.cfg.num_heads // self.cfg.num_kv_heads
        normed = self.attn_norm(slots)
        q = self._project(normed, slot_positions, self.q, True).reshape(batch, size, kv, groups, self.cfg.head_dim)
        block_k = self._project(normed, slot_positions, self.k, True)
        block_v = self._project(normed, slot_positions, self.v, False)
        scale = self.cfg.head_dim ** -0.5
        to_context = jnp.einsum("bskgh,bkch->bskgc", q, keys.astype(self.dtype),
                                preferred_element_type=jnp.float32) * scale
        to_block = jnp.einsum("bskgh,brkh->bskgr", q, block_k, preferred_element_type=jnp.float32) * scale
        to_context = jnp.where(visible[:, None, None, None, :], to_context, -jnp.inf)
        probs = jax.nn.softmax(jnp.concatenate([to_context, to_block], axis=-1), axis=-1).astype(self.dtype)
        length = keys.shape[2]
        out = (jnp.einsum("bskgc,bkch->bskgh", probs[..., :length], values.astype(self.dtype))
               + jnp.einsum("bskgr,brkh->bskgh", probs[..., length:], block_v))
        out = out.reshape(batch, size, self.cfg.num_heads, self.cfg.head_dim)
        attended = dense(out, self.o[...].astype(self.dtype), in_dims=2)
        slots = slots + attended.astype(slots.dtype)
        return slots + self.mlp(self.mlp_norm(slots)).astype(slots.dtype)


class Drafter(nnx.Module):
    """Fused target features + anchor tokens → hidden states of B mask slots per block (no head of its own)."""

    def __init__(self, cfg: DrafterConfig, rngs: nnx.Rngs):
        pdt = dtype_of(cfg.param_dtype)
        self.cfg = cfg
        self.dtype = dtype_of(cfg.dtype)
        fused = cfg.dim * len(cfg.target_layers)
        self.fuse = param(rngs, (fused, cfg.dim), ("mlp", "embed"), pdt)
        self.context_norm = RMSNorm(cfg.dim, cfg.norm_eps, pdt, rngs)
        self.mask_embedding = param(rngs, (cfg.dim,), ("embed",), pdt)
        self.layers = nnx.List([DrafterLayer(cfg, rngs) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.dim, cfg.norm_eps, pdt, rngs)

    def __call__(self, features, positions, segment_ids, anchors, anchor_embeddings):
        """features [B, T, k·D] (`target_features`); positions [B, T] (1-D, `text_positions`); segment_ids
        [B, T]; anchors int [B, A] (row index p of each block's anchor); anchor_embeddings [B, A, D] (the
        target's embedding of x_p). Returns final-normed hidden states [B, A, block_size, D]: entry k-1
        predicts x_{p+k}."""
        batch, blocks = anchors.shape
        size = self.cfg.block_size + 1
        context = self.context_norm(dense(features.astype(self.dtype), self.fuse[...].astype(self.dtype)))
        mask = jnp.broadcast_to(self.mask_embedding[...].astype(self.dtype), (batch, blocks, size - 1, self.cfg.dim))
        slots = jnp.concatenate([anchor_embeddings.astype(self.dtype)[:, :, None, :], mask], axis=2)
        anchor_positions = jnp.take_along_axis(positions, anchors, axis=1)
        slot_positions = anchor_positions[..., None] + jnp.arange(size, dtype=positions.dtype)
        anchor_segments = jnp.take_along_axis(segment_ids, anchors, axis=1)
        length = features.shape[1]
        # Context t is visible to the block anchored at p when t < p in the same (non-padding) segment.
        context_mask = ((jnp.arange(length)[None, None, :] < anchors[..., None])
                        & (segment_ids[:, None, :] == anchor_segments[..., None])
                        & (anchor_segments[..., None] > 0))
        for layer in self.layers:
            slots = layer(slots, slot_positions, context, positions, context_mask)
        return self.final_norm(slots[:, :, 1:])

    # -- decoding with a context cache (decoding.draft_rules) -------------------------------------------
    # The fused features enter only through each layer's context keys/values, so those are what a
    # decoder caches ([L_d, B, K, S, H], `kv_cache` layout): written once per committed token, and a
    # pass costs one small forward over the B + 1 slots attending to the cache.

    def context(self, features):
        """Fused target features [B, T, k·D] → the normed context [B, T, D] (`__call__`'s first line)."""
        return self.context_norm(dense(features.astype(self.dtype), self.fuse[...].astype(self.dtype)))

    def context_cache(self, features, positions, length: int) -> kv_cache.KVCache:
        """A cache of `length` slots holding every layer's context keys/values of `features` [B, P, k·D]
        at 1-D `positions` [B, P] in slots [0, P) (a prompt's prefill)."""
        context = self.context(features)
        keys, values = zip(*(layer.context_keys_values(context, positions) for layer in self.layers), strict=True)
        return kv_cache.from_prefill(jnp.stack(keys), jnp.stack(values), length)

    def write_context(self, cache: kv_cache.KVCache, features, positions, cursor) -> kv_cache.KVCache:
        """`cache` with the context keys/values of T new tokens per row (features [B, T, k·D], positions
        [B, T]) at slots cursor[b] .. cursor[b] + T - 1 (a verify pass or a decode step)."""
        context = self.context(features)
        for i, layer in enumerate(self.layers):
            keys, values = layer.context_keys_values(context, positions)
            cache = kv_cache.write_block(cache, i, keys, values, cursor)
        return cache

    def draft_cached(self, cache: kv_cache.KVCache, cursor, anchor_embeddings, anchor_positions):
        """`__call__` for one block per row whose anchor sits at slot cursor[b]: the block attends the
        cached context of slots < cursor[b] (every token before the anchor). anchor_embeddings [B, D];
        anchor_positions [B] (1-D) → final-normed hidden states [B, block_size, D]."""
        batch = anchor_embeddings.shape[0]
        size = self.cfg.block_size + 1
        mask = jnp.broadcast_to(self.mask_embedding[...].astype(self.dtype), (batch, size - 1, self.cfg.dim))
        slots = jnp.concatenate([anchor_embeddings.astype(self.dtype)[:, None, :], mask], axis=1)
        slot_positions = anchor_positions[:, None] + jnp.arange(size, dtype=anchor_positions.dtype)
        visible = jnp.arange(cache.length)[None, :] < cursor[:, None]
        for i, layer in enumerate(self.layers):
            keys, values = kv_cache.layer_view(cache, i)
            slots = layer.cached(slots, slot_positions, keys, values, visible)
        return self.final_norm(slots[:, 1:])


def draft_hidden(drafter: Drafter, target: Transformer, batch: dict, anchors):
    """The drafter's mask-slot hidden states [B, A, block_size, D] for `anchors` [B, A] of a token batch.
    The target's features are constants to the drafter: no gradient flows back into them."""
    vision = (batch["patches"], batch["patch_positions"], batch["patch_segments"]) if "patches" in batch else None
    features = jax.lax.stop_gradient(target_features(target, drafter.cfg.target_layers, batch["tokens"],
                                                     batch["positions"], batch["segment_ids"], vision))
    anchor_tokens = jnp.take_along_axis(batch["tokens"], anchors, axis=1)
    anchor_embeddings = jax.lax.stop_gradient(jnp.take(target.embed[...], anchor_tokens, axis=0))
    return drafter(features, text_positions(batch["positions"]), batch["segment_ids"], anchors, anchor_embeddings)


def propose(drafter: Drafter, target: Transformer, batch: dict, anchors):
    """Greedy block proposals int32 [B, A, block_size]: one drafter pass per call, whatever the block size."""
    hidden = draft_hidden(drafter, target, batch, anchors)
    logits = jnp.einsum("basd,dv->basv", hidden, target.head_matrix(), preferred_element_type=jnp.float32)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def drafter_flops_per_step(cfg: DrafterConfig, target: ModelConfig, batch: int, seq: int, anchors: int) -> float:
    """Model FLOPs of one `vflash` step (for MFU): the target's forward through its deepest fused layer
    (2 per matmul parameter per token, causal attention) and the drafter's forward and backward (6 per
    parameter per token: the fused context on every token, `anchors` blocks of B + 1 slots per row
    attending to the whole row, and the target's head on their B mask slots)."""
    tokens = batch * seq
    depth = max(cfg.target_layers) + 1
    attn = target.dim * target.head_dim * (2 * target.num_heads + 2 * target.num_kv_heads)
    layer = attn + 3 * target.dim * target.mlp_dim
    target_flops = 2.0 * depth * layer * tokens + depth * 2 * seq * target.num_heads * target.head_dim * tokens
    slots = batch * min(anchors, seq) * (cfg.block_size + 1)
    kv = 2 * cfg.dim * cfg.num_kv_heads * cfg.head_dim
    context = len(cfg.target_layers) * cfg.dim * cfg.dim + cfg.num_layers * kv  # per token of the row
    per_slot = cfg.num_layers * (layer + 4 * (seq + cfg.block_size + 1) * cfg.num_heads * cfg.head_dim)
    head = cfg.block_size / (cfg.block_size + 1) * cfg.dim * target.vocab_size
    return target_flops + 6.0 * (context * tokens + (per_slot + head) * slots)


def abstract_drafter(cfg: DrafterConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """Shapes and metadata only, for shardings before anything is allocated."""
    return nnx.split(nnx.eval_shape(lambda: Drafter(cfg, nnx.Rngs(0))))


def init_drafter_params(cfg: DrafterConfig, seed: int, shardings) -> dict:
    """Fresh drafter parameters, created directly in their shardings."""

    def create():
        return nnx.to_pure_dict(nnx.split(Drafter(cfg, nnx.Rngs(seed)))[1])

    return jax.jit(create, out_shardings=shardings)()


__all__ = ["DrafterConfig", "Drafter", "DrafterLayer", "default_target_layers", "target_features", "draft_hidden",
           "propose", "drafter_flops_per_step", "abstract_drafter", "init_drafter_params", "text_positions"]

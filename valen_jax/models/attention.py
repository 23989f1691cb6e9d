"""Attention behind one seam: masks from ids, one call for every full-sequence pass.

`attend(q, k, v, segment_ids, branch_ids, causal=..., implementation=...)` is how the decoder and the
vision towers attend over whole rows (training, evaluation forwards, decoding's prefill). The mask is
never an argument: every implementation builds what it needs from the ids, tile by tile
(`attention_masks.tile_mask`, a leaf the kernels share), so no [T, T] array exists in the model path
(`reference` builds the dense mask, for tests only). The rule, for query q and key k:

    allowed(q, k) = (seg[q] == seg[k] > 0) and (not causal or k <= q)
                    and (kb == 0 or kb == qb)            # branch trees: a branch sees the prefix and itself
                    or q == k                            # every row keeps its diagonal (padding: only itself)

`blockwise`, `flash` and `cudnn` take branch trees as that mask function (one extra compare per tile).
`splash` cannot: its segment ids are an equivalence, and a prefix is seen by every branch. It runs the
kernel twice (queries against the prefix keys, branch queries against their own branch) and merges
the two by their log-sum-exp, with a custom VJP (`attention_accel.py`).

Outside the seam, on purpose: attention against a KV cache (`kv_cache.attend_token` for one query per
row, `attend_block` for a verify or draft block) and the VFlash drafter's layers (`models/drafter.py`,
`__call__` in training and `cached` in decoding). Their masks are a cursor per row (slots <= cursor,
causal within the block) or the drafter's own (block slots see the target's context and each other
bidirectionally), not segment or branch ids, and their query blocks are 1 to B + 1 tokens long, where a
tiled kernel has nothing to tile; each computes f32 scores and softmax as every implementation here does,
and tests hold them to the full-sequence forward through this seam (tests/test_kv_cache.py: cached
greedy and prefill logits equal the full forward; tests/test_speculative.py: cached drafting equals
`draft_hidden` over the whole context).

Implementations (`IMPLEMENTATIONS`): `blockwise` (CPU-tuned: unrolled query blocks, blocks above
the diagonal skipped; `attention_blockwise.py`), `flash` (portable online softmax with a
recomputing backward, O(T) residuals, any backend; `attention_flash.py`), `splash` (TPU Pallas) and
`cudnn` (GPU) in `attention_accel.py`, and `auto`, which `resolve` turns into one of them.
"""

from __future__ import annotations

import importlib
import logging

import jax
import jax.numpy as jnp

from valen_jax.models.attention_blockwise import blockwise_attention
from valen_jax.models.attention_flash import flash_attention
from valen_jax.models.attention_masks import reference_mask
from valen_jax.models.platform import target_platform

log = logging.getLogger(__name__)

IMPLEMENTATIONS = ("auto", "cudnn", "splash", "flash", "blockwise")
_ACCELERATED = {"splash": "splash_attention", "cudnn": "cudnn_attention"}
# On CPU the unrolled blockwise kernel is the fastest measured (benchmarks/train_step.py), but its
# residuals are O(T²) per layer; past this length flash's O(T) memory matters more than speed.
CPU_BLOCKWISE_MAX_LENGTH = 8192
_logged: set[tuple] = set()


def reference(q, k, v, segment_ids, branch_ids=None, *, causal: bool):
    """Dense masked softmax attention in f32 (tests only): the definition every implementation matches."""
    groups = q.shape[2] // k.shape[2]
    keys = jnp.repeat(k.astype(jnp.float32), groups, axis=2)
    values = jnp.repeat(v.astype(jnp.float32), groups, axis=2)
    scores = jnp.einsum("bqnh,bknh->bnqk", q.astype(jnp.float32), keys) * q.shape[-1] ** -0.5
    scores = jnp.where(reference_mask(segment_ids, branch_ids, causal=causal), scores, -jnp.inf)
    out = jnp.einsum("bnqk,bknh->bqnh", jax.nn.softmax(scores, axis=-1), values)
    return out.astype(q.dtype)


def _accelerated_module():
    try:
        return importlib.import_module("valen_jax.models.attention_accel")
    except ModuleNotFoundError as error:
        if error.name != "valen_jax.models.attention_accel":
            raise
        return None


def resolve(implementation: str, seq_len: int) -> str:
    """A concrete implementation for the target's platform (`platform.target_platform`: the mesh being
    traced under, not the host) and row length ("auto" → one, logged once)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"config.model.attention={implementation!r}; choose one of {', '.join(IMPLEMENTATIONS)}")
    if implementation != "auto":
        return implementation
    backend = target_platform()
    accel = _accelerated_module()
    if backend == "tpu" and accel is not None:
        chosen, why = "splash", "TPU: the Pallas splash kernel"
    elif backend == "gpu" and accel is not None:
        chosen, why = "cudnn", "GPU: cuDNN flash attention"
    elif backend == "cpu" and seq_len <= CPU_BLOCKWISE_MAX_LENGTH:
        chosen, why = "blockwise", f"CPU at {seq_len} <= {CPU_BLOCKWISE_MAX_LENGTH} tokens: the fastest here"
    else:
        chosen, why = "flash", (f"{backend} at {seq_len} tokens: portable online softmax, O(T) memory"
                                + ("" if backend == "cpu" else " (attention_accel is not installed)"))
    if (backend, seq_len, chosen) not in _logged:
        _logged.add((backend, seq_len, chosen))
        log.info("config.model.attention=auto: %s for %d tokens (%s)", chosen, seq_len, why)
    return chosen


def choose(implementation: str, seq_len: int, dtype, *, causal: bool, branches: bool) -> str:
    """`resolve`, then what `auto` does for one call: on GPU cuDNN takes only what its packed layout
    expresses, so `flash` gets the rest: f32 inputs (cuDNN is 16-bit only), branch trees (not
    contiguous segments), and bidirectional (vision) rows, whose frame/window ids
    (`qwen_vision.cell_segments`) are neither contiguous runs nor bounded by cuDNN's 64 runs a row.
    An explicit choice is never changed (the kernel refuses what it cannot do, by name)."""
    chosen = resolve(implementation, seq_len)
    if implementation != "auto" or chosen != "cudnn":
        return chosen
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        why = f"{jnp.dtype(dtype).name} inputs (cuDNN takes bf16/f16 only)"
    elif branches:
        why = "branch trees (cuDNN's packed layout holds contiguous segments only)"
    elif not causal:
        why = "bidirectional (vision) rows: frame/window ids are not contiguous runs"
    else:
        return chosen
    if ("cudnn", why) not in _logged:
        _logged.add(("cudnn", why))
        log.info("config.model.attention=auto: flash instead of cudnn for %s", why)
    return "flash"


def attend(q, k, v, segment_ids, branch_ids=None, *, causal: bool, implementation: str = "auto"):
    """q [B, T, N, H]; k, v [B, T, K, H] (N a multiple of K: grouped-query); segment_ids int32 [B, T]
    (0 = padding, which attends only to itself); branch_ids int32 [B, T] or None (0 = shared prefix,
    k > 0 = branch k: a branch sees the prefix and itself). causal=False: bidirectional within a segment
    (vision). Returns [B, T, N, H] in q.dtype. Allowed(q, k) = same segment > 0 and (not causal or k ≤ q)
    and (branch_ids is None or kb == 0 or kb == qb); plus the diagonal always."""
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"attention: {q.shape[2]} query heads are not a multiple of {k.shape[2]} key/value heads")
    chosen = choose(implementation, q.shape[1], q.dtype, causal=causal, branches=branch_ids is not None)
    if chosen in _ACCELERATED:
        accel = _accelerated_module()
        if accel is None:
            raise NotImplementedError(
                f"config.model.attention={chosen!r} needs valen_jax/models/attention_accel.py, which is not "
                f"installed in this tree; use 'flash' (any backend) or 'blockwise' (CPU)")
        kernel = getattr(accel, _ACCELERATED[chosen])
        return kernel(q, k, v, segment_ids, branch_ids, causal=causal)
    if chosen == "flash":
        return flash_attention(q, k, v, segment_ids, branch_ids, causal=causal)
    return blockwise_attention(q, k, v, segment_ids, branch_ids, causal=causal)

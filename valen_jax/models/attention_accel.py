"""Accelerator attention kernels behind `attention.attend`: splash (TPU Pallas) and cuDNN (GPU).

Both take the seam's arguments (q [B, T, N, H]; k, v [B, T, K, H]; segment_ids, branch_ids [B, T])
and return what `attention.reference` returns, without a dense [T, T] mask:

* `splash_attention`: the Pallas splash kernel (MQA form, one call per key/value head: GQA) with a
  static causal (or full) mask whose block sparsity the kernel skips, and the ids as its segment ids.
  Padding (segment 0) attends only to itself: each padding token gets its own negative id.
  Branch trees cannot be splash segment ids (the prefix is seen by every branch, not an equivalence
  relation) nor a splash mask function (those see indices, never data), so a tree is TWO passes of
  the same kernel merged by their log-sum-exp: (a) every query against the prefix keys (kb == 0),
  (b) branch queries against their own branch (kb == qb > 0). Every allowed (q, k) lies in exactly
  one pass, so softmax over the union = the LSE-weighted sum of the two pass outputs. The kernel's own
  VJP cannot differentiate its log-sum-exp output ("Higher-order AD not supported"), so the merge has
  a custom VJP: each pass's backward kernel runs with the MERGED output and log-sum-exp as its
  residuals, which gives exactly that pass's share of the gradient of the full softmax (the
  ring-attention identity); dq/dk/dv are the sums. That backward calls the kernel module's
  `_splash_attention_bwd` (pinned JAX; tests/test_attention_accel.py runs it in interpret mode).
  On a multi-device mesh the kernel runs per shard inside a shard_map (XLA cannot partition it).
* `cudnn_attention`: cuDNN flash attention in its packed layout (per-row segment offsets and lengths,
  `PADDING_CAUSAL`), built from the segment ids (up to CUDNN_MAX_SEGMENTS runs per row); padding
  rows are set to their own value (what the reference gives them). Untested on a GPU so far: only
  its arguments are checked, against JAX's own cuDNN checks, on CPU. Branch trees are refused: cuDNN's packed layout expresses contiguous
  segments only, and a two-pass merge would need cuDNN's private backward, which no GPU here could
  test; `attend(implementation="auto")` runs them with `flash` on GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from valen_jax.models.platform import target_platform

_INT32_MIN = int(np.iinfo(np.int32).min)
# Ids no real token has (real: segment ids >= 1, padding -1..-T, branch pairs in between):
# queries that must see no key of a pass, and keys no query may see. Distinct, so they never match.
_NO_QUERY = _INT32_MIN + 1
_NO_KEY = _INT32_MIN
# Pairs (segment, branch) are encoded as segment * (T + 1) + branch in int32.
_MAX_BRANCH_TREE_LENGTH = 46_000
# Runs of segments per row cuDNN's packed layout is built for. It is a static shape: cuDNN walks
# rows x this many slots, so T/2 (always enough) would make it scan thousands of empty slots per row.
# Decoder rows hold at most data.max_segments (default 16) examples; vision rows one run per media item.
CUDNN_MAX_SEGMENTS = 64


def splash_block(length: int) -> int:
    """Kernel tile from the row length: 512 (the kernel's sweet spot on TPU v4/v5) for long rows,
    else the length rounded up to the 128-lane minimum the Mosaic kernel needs."""
    return min(512, -(-length // 128) * 128)


@functools.lru_cache(maxsize=32)
def _splash_kernel(length: int, groups: int, causal: bool, block: int, interpret: bool, residuals: bool):
    # Imported here: the Pallas TPU ops import Mosaic lowering modules that are not needed elsewhere.
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sak
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sam

    shape = (length, length)
    head_mask = sam.CausalMask(shape) if causal else sam.FullMask(shape)
    sizes = sak.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                           block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    # The mask tables are numpy → constants; built outside any trace so the cache holds no tracer.
    # The kernel's constructor turns them into arrays with `jnp.array`, which under compile-time eval
    # RUNS a small program on the context's devices: those of the concrete mesh (`jax.set_mesh`) when
    # one is set. A mesh of compile-only TPU devices (the ahead-of-time compile from a CPU host) cannot
    # execute anything ("'Executable' object has no attribute 'local_devices'"), so the tables are made
    # on the host's default device with no concrete mesh in context; they end as constants of the
    # traced program either way, so where they were made does not reach the compiled step.
    with jax.ensure_compile_time_eval(), _no_concrete_mesh():
        return sak.make_splash_mqa_single_device(sam.MultiHeadMask([head_mask] * groups), block_sizes=sizes,
                                                 save_residuals=residuals, interpret=interpret)


def _no_concrete_mesh():
    """The concrete mesh of `jax.set_mesh` out of context for a moment (the abstract mesh, which the
    trace reads, stays). `jax.set_mesh(None)` would do it but is refused inside `jit`, so this enters the
    empty concrete mesh, what `set_mesh(None)` sets, through JAX's own internal context manager: one
    spelling for jax 0.10 to 0.12, where the thread-local behind it moved from `config` to `mesh`."""
    from jax._src import mesh as jax_mesh  # noqa: PLC2701 — see the docstring
    from jax._src import sharding_impls  # noqa: PLC2701

    return sharding_impls._internal_use_concrete_mesh(jax_mesh.empty_concrete_mesh)  # noqa: SLF001


def _splash_ids(segment_ids, branch_ids, padded: int):
    """Per-pass (query ids, key ids) [B, padded] int32 for the splash kernel's segment-id mask."""
    batch, length = segment_ids.shape
    position = jnp.arange(length, dtype=jnp.int32)
    # Padding attends only to itself: a unique negative id per padding token.
    own = jnp.where(segment_ids > 0, segment_ids.astype(jnp.int32), -(position + 1)[None])

    def pad(ids, fill):
        return jnp.pad(ids, ((0, 0), (0, padded - length)), constant_values=fill)

    if branch_ids is None:
        return [(pad(own, _NO_QUERY), pad(own, _NO_KEY))]
    if length > _MAX_BRANCH_TREE_LENGTH:
        raise ValueError(f"splash_attention: branch trees are encoded as int32 (segment, branch) pairs, "
                         f"which holds rows up to {_MAX_BRANCH_TREE_LENGTH} tokens, not {length}; "
                         f"use config.model.attention='flash' for longer Valen rows")
    branch = branch_ids.astype(jnp.int32)
    # (a) every query against the prefix keys of its segment (and itself when it is in the prefix).
    prefix_keys = jnp.where(branch == 0, own, _NO_KEY)
    # (b) branch queries against the keys of the same (segment, branch); prefix queries see nothing here.
    pair = own * (length + 1) + branch
    branch_queries = jnp.where(branch > 0, pair, _NO_QUERY)
    branch_keys = jnp.where(branch > 0, pair, _NO_KEY)
    return [(pad(own, _NO_QUERY), pad(prefix_keys, _NO_KEY)),
            (pad(branch_queries, _NO_QUERY), pad(branch_keys, _NO_KEY))]


def _per_row_and_head(fn):
    # fn(q [G, T, H], k [T, H], v [T, H], q_ids [T], k_ids [T]) → over kv heads, then rows.
    return jax.vmap(jax.vmap(fn, in_axes=(0, 0, 0, None, None)), in_axes=(0, 0, 0, 0, 0))


def _segment_ids(sak, q_ids, k_ids):
    return sak.SegmentIds(q=q_ids, kv=k_ids)


def _single_pass(spec, q, k, v, q_ids, k_ids):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sak

    kernel = _splash_kernel(*spec, residuals=False)
    return _per_row_and_head(lambda q, k, v, qi, ki: kernel(q, k, v, segment_ids=_segment_ids(sak, qi, ki)))(
        q, k, v, q_ids, k_ids)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _merged_passes(spec, q, k, v, ids):
    return _merged_forward(spec, q, k, v, ids)[0]


def _merged_forward(spec, q, k, v, ids):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sak

    kernel = _splash_kernel(*spec, residuals=True)
    run = _per_row_and_head(lambda q, k, v, qi, ki: kernel(q, k, v, segment_ids=_segment_ids(sak, qi, ki)))
    outs, lses = [], []
    for q_ids, k_ids in ids:
        out, (lse,) = run(q, k, v, q_ids, k_ids)
        outs.append(out.astype(jnp.float32))
        lses.append(lse.astype(jnp.float32))
    # A query with no key in a pass has lse ≈ the kernel's mask value (-0.7 · f32 max): weight 0.
    total = functools.reduce(jnp.logaddexp, lses)
    merged = sum(jnp.exp(lse - total)[..., None] * out for lse, out in zip(lses, outs, strict=True))
    return merged.astype(q.dtype), total


def _merged_fwd(spec, q, k, v, ids):
    out, total = _merged_forward(spec, q, k, v, ids)
    return out, (q, k, v, ids, out, total)


def _merged_bwd(spec, residuals, d_out):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sak

    q, k, v, ids, out, total = residuals
    kernel = _splash_kernel(*spec, residuals=False)
    options = kernel.kwargs

    def collapse(info):  # as the kernel's own entry point does before its custom VJP
        if info is None or info.partial_mask_blocks is None:
            return info
        return info._replace(partial_mask_blocks=info.partial_mask_blocks.reshape(
            -1, *info.partial_mask_blocks.shape[-2:]))

    def backward(q, k, v, d_out, out, total, q_ids, k_ids):
        res = (q, k, v, _segment_ids(sak, q_ids, k_ids), None, out, total,
               collapse(kernel.dq_mask_info), collapse(kernel.dkv_mask_info))
        grads = sak._splash_attention_bwd(  # noqa: SLF001 — see the module docstring
            False, options["mask_value"], options["is_mqa"], options["block_sizes"], None,
            options["mask_function"], options["attn_logits_soft_cap"], options["interpret"], res, d_out)
        return grads[3:6]

    per_head = jax.vmap(backward, in_axes=(0, 0, 0, 0, 0, 0, None, None))
    per_row = jax.vmap(per_head, in_axes=(0,) * 8)
    dq = jnp.zeros(q.shape, jnp.float32)
    dk = jnp.zeros(k.shape, jnp.float32)
    dv = jnp.zeros(v.shape, jnp.float32)
    for q_ids, k_ids in ids:
        gq, gk, gv = per_row(q, k, v, d_out, out, total, q_ids, k_ids)
        dq, dk, dv = dq + gq, dk + gk, dv + gv
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), jax.tree.map(lambda _: None, ids)


_merged_passes.defvjp(_merged_fwd, _merged_bwd)


def splash_attention(q, k, v, segment_ids, branch_ids=None, *, causal: bool, interpret: bool = False,
                     block: int | None = None):
    """The seam's attention with the Pallas TPU splash kernel (`interpret=True`: Pallas interpreter,
    any backend, for tests). The row is padded to a multiple of the tile (`block`, default from the
    length) with ids that see nothing, and cut back. Under a multi-device mesh (`jax.set_mesh`, as the
    train step runs) the kernel runs per shard in a shard_map: XLA cannot partition a Mosaic kernel."""
    if not interpret and target_platform() != "tpu":
        raise RuntimeError(f"config.model.attention='splash' is the TPU Pallas kernel; this program is built for "
                           f"{target_platform()!r} devices (use 'cudnn' on GPU, 'flash' or 'blockwise' elsewhere)")
    local = functools.partial(_splash_local, causal=causal, interpret=interpret, block=block)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return local(q, k, v, segment_ids, branch_ids)
    return _over_mesh(local, mesh, q, k, v, segment_ids, branch_ids)


def _over_mesh(local, mesh, q, k, v, segment_ids, branch_ids):
    """`local` per shard: rows split like the model's activations ("batch" → data × fsdp), heads split
    over "tensor" when both head counts divide by it (else every tensor shard computes all heads)."""
    from jax.sharding import PartitionSpec

    from valen_jax.models.sharding import DEFAULT_RULES

    def present(axes):
        axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
        return tuple(a for a in axes if a in mesh.axis_names and mesh.shape[a] > 1)

    rows = present(DEFAULT_RULES["batch"])
    row_shards = int(np.prod([mesh.shape[a] for a in rows]))
    if q.shape[0] % row_shards:
        # Fewer rows than row shards: the speculative block loop decodes one row per program (and a vision
        # tower's images may be fewer than the shards). Every shard then runs all the rows; the train step's
        # batch always splits (config_schema.check_batch_split), so only such small programs come here.
        rows = ()
    heads = present(DEFAULT_RULES["heads"])
    head_shards = int(np.prod([mesh.shape[a] for a in heads]))
    if q.shape[2] % head_shards or k.shape[2] % head_shards:
        heads = ()
    row_spec = rows or None
    qkv = PartitionSpec(row_spec, None, heads or None, None)
    ids = PartitionSpec(row_spec, None)
    if branch_ids is None:
        run = jax.shard_map(lambda q, k, v, s: local(q, k, v, s, None), mesh=mesh,
                            in_specs=(qkv, qkv, qkv, ids), out_specs=qkv, check_vma=False)
        return run(q, k, v, segment_ids)
    run = jax.shard_map(local, mesh=mesh, in_specs=(qkv, qkv, qkv, ids, ids), out_specs=qkv, check_vma=False)
    return run(q, k, v, segment_ids, branch_ids)


def _splash_local(q, k, v, segment_ids, branch_ids, *, causal: bool, interpret: bool, block: int | None):
    batch, length, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    groups = heads // kv_heads
    block = splash_block(length) if block is None else block
    padded = -(-length // block) * block
    spec = (padded, groups, bool(causal), block, bool(interpret))

    def layout(x, grouped):
        x = jnp.pad(x, ((0, 0), (0, padded - length), (0, 0), (0, 0)))
        if grouped:  # [B, T, N, H] → [B, K, G, T, H]: query head n uses kv head n // G, as jnp.repeat does.
            return x.reshape(batch, padded, kv_heads, groups, head_dim).transpose(0, 2, 3, 1, 4)
        return x.transpose(0, 2, 1, 3)  # [B, K, T, H]

    # The kernel does not scale the scores; scaling q in f32 first keeps bf16 rounding to one step.
    scaled = (q.astype(jnp.float32) * head_dim ** -0.5).astype(q.dtype)
    qg, kk, vv = layout(scaled, True), layout(k, False), layout(v, False)
    ids = _splash_ids(segment_ids, branch_ids, padded)
    if branch_ids is None:
        out = _single_pass(spec, qg, kk, vv, *ids[0])
    else:
        out = _merged_passes(spec, qg, kk, vv, ids)
    out = out.transpose(0, 3, 1, 2, 4).reshape(batch, padded, heads, head_dim)
    return out[:, :length].astype(q.dtype)


# --- cuDNN (GPU) ---------------------------------------------------------------------------------


def segment_layout(segment_ids, max_segments: int | None = None):
    """cuDNN's packed layout from segment ids: offsets int32 [B, M + 1] and lengths [B, M] of the
    runs of equal non-zero ids, -1 past a row's last run (what fused_attention_stablehlo takes), and
    a bool [B] that is True where a row cannot be described: more than M runs, or an id that comes
    back after another (packing writes 1, 2, 3, ... in order, so this flags foreign ids).
    M defaults to CUDNN_MAX_SEGMENTS, at most (T + 1) // 2 (the most runs a row can hold)."""
    batch, length = segment_ids.shape
    # At least 2 slots: with one, cuDNN takes its unpacked path, which reads lengths of rank 1.
    limit = max(2, min(CUDNN_MAX_SEGMENTS if max_segments is None else int(max_segments), (length + 1) // 2))
    ids = segment_ids.astype(jnp.int32)
    previous = jnp.pad(ids, ((0, 0), (1, 0)), constant_values=0)[:, :-1]
    following = jnp.pad(ids, ((0, 0), (0, 1)), constant_values=0)[:, 1:]
    starts = (ids > 0) & (ids != previous)
    ends = (ids > 0) & (ids != following)

    def positions(flags):
        return jax.vmap(lambda row: jnp.nonzero(row, size=limit, fill_value=-1)[0])(flags).astype(jnp.int32)

    first, last = positions(starts), positions(ends)
    lengths = jnp.where(first >= 0, last - first + 1, -1).astype(jnp.int32)
    offsets = jnp.concatenate([first, jnp.full((batch, 1), -1, jnp.int32)], axis=1)
    too_many = jnp.sum(starts, axis=1) > limit
    # A run whose id is not above every earlier id: the same segment split in two runs (or unordered).
    best_before = jax.lax.cummax(previous, axis=1)
    returning = jnp.any(starts & (ids <= best_before), axis=1)
    return offsets, lengths, too_many | returning


def cudnn_attention(q, k, v, segment_ids, branch_ids=None, *, causal: bool, max_segments: int | None = None):
    """The seam's attention with cuDNN flash attention (GPU, bf16/f16). Packed segments go in as
    cuDNN's per-row offsets/lengths (no mask array); a row those cannot describe (see
    `segment_layout`) comes out NaN, so the run stops on a non-finite loss instead of training on a
    wrong mask. `max_segments` bounds the runs per row (default CUDNN_MAX_SEGMENTS)."""
    if branch_ids is not None:
        raise NotImplementedError(
            "config.model.attention='cudnn' does not take Valen branch trees (branch_ids): cuDNN's packed "
            "layout expresses contiguous segments only; use 'flash' (what 'auto' picks for them on GPU) or "
            "'splash' on TPU")
    if target_platform() != "gpu":
        raise RuntimeError(f"config.model.attention='cudnn' needs a CUDA GPU with cuDNN; this program is built "
                           f"for {target_platform()!r} devices (use 'flash' or 'blockwise')")
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"config.model.attention='cudnn' takes bfloat16/float16 inputs, not {q.dtype}; "
                         f"set config.model.dtype=bfloat16 or use 'flash'")
    from jax._src.cudnn import fused_attention_stablehlo as cudnn  # offsets are not in jax.nn's signature

    offsets, lengths, undescribed = segment_layout(segment_ids, max_segments)
    mask_type = cudnn.MaskType.PADDING_CAUSAL if causal else cudnn.MaskType.PADDING
    out = cudnn.dot_product_attention(q, k, v, None, None, lengths, lengths, offsets, offsets,
                                      scale=q.shape[-1] ** -0.5, mask_type=mask_type, qkv_layout="BTNH")
    # Padding is in no segment; the reference gives it its own value (it attends only to itself).
    own_value = jnp.repeat(v, q.shape[2] // k.shape[2], axis=2)
    out = jnp.where((segment_ids > 0)[:, :, None, None], out, own_value)
    return jnp.where(undescribed[:, None, None, None], jnp.nan, out).astype(q.dtype)

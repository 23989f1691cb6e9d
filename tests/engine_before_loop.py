"""`decoding.engine` as it was before issue 30 (commit 03a4193), frozen as a test oracle: its own
prefill → first token → `while_loop` of decode steps, which the one decode loop (`decoding.loop` with no
drafter) replaced. `tests/test_speculative_batch.py` checks that the loop gives its tokens bit for bit
(text, scanned and unscanned; M-RoPE with an image; greedy and sampled). Not library code: nothing
imports it but that test.

KV-cache generation: prefill each batch of prompts once, then decode one token per row per step.

The whole of one batch's generation is one jitted call: the prefill (vision inputs included), the
first token, and a `lax.while_loop` of decode steps that stops when every row is done (a stop id
produced, or `max_new_tokens` reached). Keeping the loop on the device saves a host round trip per
token, and since its condition is a reduction over the global batch, every process of a multi-host
run takes the same number of steps.

Shapes are bucketed (`bucket`): the prompt length, the cache length (prompt + new tokens) and the
output buffer round up to a small set of sizes, so evaluation over prompts of many lengths compiles a
handful of programs, each once per model (`_generate_fn` is cached per graphdef and sampling).

A row's random stream is `fold_in(fold_in(key(seed), global prompt index), step)`: the tokens of a
prompt depend on the seed and its index only, not on the batch it was put in.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from valen_jax.decoding.sampling import Sampling, sample
from valen_jax.models import sharding
from valen_jax.models.sharding import constrain

GREEDY = Sampling()  # the default: argmax, no randomness

# Bucket sizes: 64·2^k and 96·2^k (at most 1.5x padding), from 64 up.
_SMALLEST_BUCKET = 64


def bucket(n: int) -> int:
    """The smallest size >= n in {64, 96, 128, 192, 256, 384, ...}."""
    size = _SMALLEST_BUCKET
    while True:
        if n <= size:
            return size
        if n <= size * 3 // 2:
            return size * 3 // 2
        size *= 2


def _check_prompt(index: int, prompt: dict, mrope: bool) -> tuple[np.ndarray, np.ndarray]:
    ids = np.asarray(prompt["ids"])
    positions = np.asarray(prompt["positions"])
    where = f"prompts[{index}]"
    if ids.ndim != 1 or len(ids) == 0:
        raise ValueError(f"{where}: ids must be a non-empty 1-D array of token ids, got shape {ids.shape}")
    if not np.issubdtype(ids.dtype, np.integer) or not np.issubdtype(positions.dtype, np.integer):
        raise ValueError(f"{where}: ids and positions must be integers, got {ids.dtype} and {positions.dtype}")
    want = (len(ids), 3) if mrope and positions.ndim == 2 else (len(ids),)
    if positions.shape != want:
        raise ValueError(f"{where}: positions of shape {positions.shape} for {len(ids)} ids; want "
                         f"[{len(ids)}] or, with M-RoPE, [{len(ids)}, 3]")
    return ids, positions


def _agree_max(values: list[int]) -> list[int]:
    """Element-wise max over processes: every process must compile and run the same shapes."""
    if jax.process_count() == 1:
        return values
    from jax.experimental import multihost_utils

    gathered = multihost_utils.process_allgather(np.asarray(values, np.int64), tiled=False)
    return [int(v) for v in np.asarray(gathered).max(axis=0)]


@functools.cache
def _generate_fn(graphdef, sampling: Sampling, vocab: int, cache_length: int, out_length: int):
    def run(params, tokens, positions, lengths, next_position, active, vision, stop_ids, seed, rows, max_new):
        model = nnx.merge(graphdef, params)
        logits, cache = model.prefill(tokens, positions, lengths, cache_length, vision)
        row_keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(seed), rows)

        def choose(logits, step):
            return sample(logits, jax.vmap(jax.random.fold_in, (0, None))(row_keys, step), sampling, vocab)

        def finished(token, count):
            return jnp.isin(token, stop_ids) | (count >= max_new)

        first = choose(logits, 0)
        batch = tokens.shape[0]
        out = jnp.zeros((batch, out_length), jnp.int32).at[:, 0].set(first)
        count = jnp.ones(batch, jnp.int32)
        done = ~active | finished(first, count)
        # The state: the last token (not yet in the cache) sits at slot `cursor` with `position`.
        state = (jnp.int32(1), cache, first, lengths, next_position, done, out, count)

        def cond(state):
            step, *_, done, _, _ = state
            return (step < max_new) & ~jnp.all(done)

        def body(state):
            step, cache, last, cursor, position, done, out, count = state
            logits, cache = model.decode_step(last, position, cache, cursor)
            token = jnp.where(done, last, choose(logits, step))
            out = jax.lax.dynamic_update_slice(out, jnp.where(done, 0, token)[:, None], (0, step))
            live = (~done).astype(jnp.int32)
            count = count + live
            return (step + 1, cache, token, cursor + live, position + live, done | finished(token, count),
                    out, count)

        *_, out, count = jax.lax.while_loop(cond, body, state)
        # Batch-sharded like the inputs, so each process reads back exactly its own rows.
        return constrain(out, ("batch", None)), constrain(count, ("batch",))

    return jax.jit(run)


def generate_ids(params, graphdef, prompts, *, max_new_tokens: int, stop_ids, vocab: int,
                 sampling: Sampling = GREEDY, seed: int = 0, mesh=None,
                 local_batch: int | None = None, batches: int | None = None,
                 first_index: int = 0) -> list[list[int]]:
    """prompts[i]: {"ids": int [n], "positions": int [n] or [n, 3] (M-RoPE), optional "vision":
    the dict valen_jax.data.assemble.vision_arrays makes}. Returns each prompt's generated ids, the
    stop token kept when reached. `vocab`: ids >= vocab (embedding padding) are never produced.
    mesh=None: one device, no sharding (notebooks, tests). local_batch/batches: as tokens.greedy
    (multi-host: every process runs `batches` batches of `local_batch` rows, short ones padded).
    first_index: global index of prompts[0]; prompt g's random stream depends only on (seed, g), so
    a run repeated with the same seed gives the same tokens whatever the batching."""
    if not isinstance(sampling, Sampling):
        raise TypeError(f"sampling must be a decoding.Sampling, got {type(sampling).__name__}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
    if not 0 <= seed < 2 ** 32:
        raise ValueError(f"seed={seed} must be in [0, 2**32)")
    if mesh is None and jax.process_count() > 1:
        raise ValueError("generate_ids without a mesh runs on one device; a multi-process run needs mesh=")
    model_cfg = nnx.merge(graphdef, params).cfg
    mrope = model_cfg.mrope_section is not None
    checked = [_check_prompt(i, p, mrope) for i, p in enumerate(prompts)]
    local_batch = int(local_batch or max(len(prompts), 1))
    batches = int(-(-len(prompts) // local_batch) if batches is None else batches)
    if batches * local_batch < len(prompts):
        raise ValueError(f"{batches} batches of {local_batch} rows cannot hold {len(prompts)} prompts")
    if max_new_tokens == 0:
        return [[] for _ in prompts]
    stops = jnp.asarray(sorted({int(s) for s in stop_ids}) or [-1], jnp.int32)
    outputs: list[list[int]] = []
    for b in range(batches):
        start = b * local_batch
        chunk = checked[start:start + local_batch]
        # A model without a vision tower ignores vision inputs (text-only specs still carry empty ones).
        vision_of = [p.get("vision") if model_cfg.vision is not None else None
                     for p in prompts[start:start + local_batch]]
        longest, patches = _agree_max([max((len(ids) for ids, _ in chunk), default=1),
                                       max((len(v["patches"]) for v in vision_of if v is not None), default=0)])
        arrays = _batch_arrays(chunk, vision_of, local_batch, bucket(longest), patches, model_cfg, mrope)
        cache_length, out_length = bucket(longest + max_new_tokens), bucket(max_new_tokens)
        fn = _generate_fn(graphdef, sampling, int(vocab), cache_length, out_length)
        rows = np.arange(first_index + start, first_index + start + local_batch, dtype=np.uint32)
        out, count = _run(fn, params, arrays, rows, stops, seed, max_new_tokens, mesh)
        outputs.extend(out[row, :count[row]].tolist() for row in range(len(chunk)))
    return outputs


def _batch_arrays(chunk, vision_of, rows: int, prompt_length: int, patches: int, model_cfg, mrope: bool) -> dict:
    """Right-padded host arrays of one batch; rows past the chunk are inactive padding."""
    tokens = np.zeros((rows, prompt_length), np.int32)
    positions = np.zeros((rows, prompt_length, 3) if mrope else (rows, prompt_length), np.int32)
    lengths = np.ones(rows, np.int32)
    next_position = np.zeros(rows, np.int32)
    active = np.zeros(rows, bool)
    for row, (ids, pos) in enumerate(chunk):
        tokens[row, :len(ids)] = ids
        # 1-D positions for an M-RoPE model are text positions: equal on the three axes.
        positions[row, :len(ids)] = pos if pos.ndim == positions.ndim - 1 else pos[:, None]
        lengths[row] = len(ids)
        # A generated token's position: the largest before it + 1 on every axis (`positions.next_position`).
        next_position[row] = int(pos.max()) + 1
        active[row] = True
    arrays = {"tokens": tokens, "positions": positions, "lengths": lengths, "next_position": next_position,
              "active": active}
    if patches:
        patch_dim = model_cfg.vision.patch_dim
        arrays["patches"] = np.zeros((rows, patches, patch_dim), np.float32)
        arrays["patch_positions"] = np.zeros((rows, patches, 3), np.int32)
        arrays["patch_segments"] = np.zeros((rows, patches), np.int32)
        for row, vision in enumerate(vision_of):
            if vision is None:
                continue
            n = len(vision["patches"])
            if n and np.shape(vision["patches"])[1:] != (patch_dim,):
                raise ValueError(f"prompt row {row}: vision patches of shape {np.shape(vision['patches'])}; "
                                 f"the model's tower takes [n, {patch_dim}]")
            arrays["patches"][row, :n] = vision["patches"]
            arrays["patch_positions"][row, :n] = vision["patch_positions"]
            arrays["patch_segments"][row, :n] = vision["patch_segments"]
    return arrays


def _run(fn, params, arrays: dict, rows, stops, seed: int, max_new_tokens: int, mesh):
    """One batch through the compiled generation; host numpy (out [B, G], count [B]) of this process's rows."""
    arrays = dict(arrays, rows=rows)
    if mesh is None:
        batch = {k: jnp.asarray(v) for k, v in arrays.items()}
    else:
        batch = sharding.global_batch(arrays, mesh)
    vision = ((batch["patches"], batch["patch_positions"], batch["patch_segments"]) if "patches" in batch
              else None)
    args = (params, batch["tokens"], batch["positions"], batch["lengths"], batch["next_position"], batch["active"],
            vision, stops, jnp.uint32(seed), batch["rows"], jnp.int32(max_new_tokens))
    if mesh is None:
        out, count = fn(*args)
        return np.asarray(out), np.asarray(count)
    with jax.set_mesh(mesh):
        out, count = fn(*args)
    return _host_local(out, mesh), _host_local(count, mesh)


def _host_local(array, mesh) -> np.ndarray:
    """This process's rows of a batch-sharded global array, in the order it supplied them."""
    if jax.process_count() == 1:
        return np.asarray(jax.device_get(array))
    from jax.experimental import multihost_utils

    spec = sharding.batch_sharding(mesh, array.ndim).spec
    return np.asarray(multihost_utils.global_array_to_host_local_array(array, mesh, spec))

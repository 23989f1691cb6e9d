"""KV-cache generation: prefill each batch of prompts once, then decode one token per row per step.

The whole of one batch's generation is one jitted call (`loop.engine_program`, the decode loop with no
drafter): the prefill (vision inputs included), the first token, and a `lax.while_loop` of decode steps
that stops when every row is done (a stop id produced, or `max_new_tokens` reached). Keeping the loop on the device saves a host round trip per
token, and since its condition is a reduction over the global batch, every process of a multi-host
run takes the same number of steps.

Shapes are bucketed (`bucket`): the prompt length, the cache length (prompt + new tokens) and the
output buffer round up to a small set of sizes, so evaluation over prompts of many lengths compiles a
handful of programs, each once per model (`engine_program` is cached per graphdef and sampling). This
module is the host side (checks, batches, multi-host); `speculative.SpeculativeDecoder` batches the same
way (`batch_arrays`) for the loop with a drafter.

A row's random stream is `fold_in(fold_in(key(seed), global prompt index), step)`: the tokens of a
prompt depend on the seed and its index only, not on the batch it was put in.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from valen_jax.decoding.loop import engine_program
from valen_jax.decoding.sampling import Sampling
from valen_jax.models import sharding

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


def check_prompt(index: int, prompt: dict, mrope: bool) -> tuple[np.ndarray, np.ndarray]:
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


def generate_ids(params, graphdef, prompts, *, max_new_tokens: int, stop_ids, vocab: int,
                 sampling: Sampling = GREEDY, seed: int = 0, mesh=None,
                 local_batch: int | None = None, batches: int | None = None,
                 first_index: int = 0, group_size: int = 1) -> list[list[int]]:
    """prompts[i]: {"ids": int [n], "positions": int [n] or [n, 3] (M-RoPE), optional "vision":
    the dict valen_jax.data.assemble.vision_arrays makes}. Returns each prompt's generated ids, the
    stop token kept when reached. `vocab`: ids >= vocab (embedding padding) are never produced.
    mesh=None: one device, no sharding (notebooks, tests). local_batch/batches: as tokens.greedy
    (multi-host: every process runs `batches` batches of `local_batch` rows, short ones padded).
    first_index: global index of prompts[0]; prompt g's random stream depends only on (seed, g), so
    a run repeated with the same seed gives the same tokens whatever the batching.
    group_size: G completions of each prompt (a reinforcement rollout's group), returned as P·G lists,
    completion k of prompt p at p·G + k with the random stream of global index (first_index + p)·G + k:
    the same tokens as `prompts` each repeated G times, but each prompt is prefilled once, not G times
    (`loop.engine_program`'s group). local_batch/batches then count prompts."""
    if not isinstance(sampling, Sampling):
        raise TypeError(f"sampling must be a decoding.Sampling, got {type(sampling).__name__}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
    if not 0 <= seed < 2 ** 32:
        raise ValueError(f"seed={seed} must be in [0, 2**32)")
    if group_size < 1:
        raise ValueError(f"group_size={group_size} must be >= 1")
    if mesh is None and jax.process_count() > 1:
        raise ValueError("generate_ids without a mesh runs on one device; a multi-process run needs mesh=")
    model_cfg = nnx.merge(graphdef, params).cfg
    mrope = model_cfg.mrope_section is not None
    checked = [check_prompt(i, p, mrope) for i, p in enumerate(prompts)]
    local_batch = int(local_batch or max(len(prompts), 1))
    batches = int(-(-len(prompts) // local_batch) if batches is None else batches)
    if batches * local_batch < len(prompts):
        raise ValueError(f"{batches} batches of {local_batch} rows cannot hold {len(prompts)} prompts")
    if max_new_tokens == 0:
        return [[] for _ in range(len(prompts) * group_size)]
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
        arrays = batch_arrays(chunk, vision_of, local_batch, bucket(longest), patches, model_cfg, mrope)
        cache_length, out_length = bucket(longest + max_new_tokens), bucket(max_new_tokens)
        fn = engine_program(graphdef, sampling, int(vocab), cache_length, out_length, int(group_size))
        first_row = (first_index + start) * group_size
        rows = np.arange(first_row, first_row + local_batch * group_size, dtype=np.uint32)
        out, count = _run(fn, params, arrays, rows, stops, seed, max_new_tokens, mesh)
        outputs.extend(out[row, :count[row]].tolist() for row in range(len(chunk) * group_size))
    return outputs


def batch_arrays(chunk, vision_of, rows: int, prompt_length: int, patches: int, model_cfg, mrope: bool) -> dict:
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

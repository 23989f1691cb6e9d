"""KV-cache generation (valen_jax.decoding.engine) equals rerunning the whole row for every token.

The reference below is the decoder the engine replaced: each step runs the full forward over the padded
row and takes the argmax at the row's last token. Cached and uncached greedy must agree token for token
on text rows of different lengths in one batch, scanned and unscanned decoders, an M-RoPE model fed
images beside text-only rows, and on an 8-device mesh.
"""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.train_runs import ROOT, env_with_devices
from valen_jax.data.positions import next_position
from valen_jax.decoding import generate_ids
from valen_jax.decoding.engine import bucket
from valen_jax.models import mrope
from valen_jax.models.config import ModelConfig, VisionConfig
from valen_jax.models.transformer import Transformer

VOCAB = 120  # the tokenizer's size; the embedding has 128 rows, the last 8 padding
IMAGE_PAD = 7
GRID = (1, 4, 4)  # one image: 16 patches, 4 merged tokens
NEW = 10


def lively(params, seed: int = 0):
    """Weights large enough that greedy continuations change from token to token (0.02-std initial
    weights make a random decoder repeat one token, which would hide a misplaced cache write)."""
    return jax.tree.map(lambda p: p * 12 if p.ndim >= 2 else p, params)


def text_model(scan: bool):
    cfg = ModelConfig(vocab_size=128, dim=32, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64,
                      scan_layers=scan, attention="blockwise")
    graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(0)))
    return graphdef, lively(params)


def vl_model():
    cfg = ModelConfig(vocab_size=128, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=64,
                      image_pad_id=IMAGE_PAD, mrope_section=(2, 3, 3), attention="blockwise",
                      vision=VisionConfig(patch_size=4, merge_size=2, temporal_patch_size=2, dim=32, num_layers=1,
                                          num_heads=2, mlp_dim=64))
    graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(1)))
    return graphdef, lively(params), cfg


def uncached_greedy(graphdef, params, prompts, max_new: int, stop_ids=()) -> list[list[int]]:
    """The old evaluation decoder: the full forward over each padded row for every new token."""
    length = max(len(p["ids"]) for p in prompts) + max_new
    forward = jax.jit(lambda p, t, pos, v: nnx.merge(graphdef, p)(t, pos, jnp.ones_like(t), v))
    out = []
    for prompt in prompts:
        ids, positions = list(prompt["ids"]), np.asarray(prompt["positions"])
        vision = None
        if "vision" in prompt:
            v = prompt["vision"]
            vision = (v["patches"][None], v["patch_positions"][None], v["patch_segments"][None])
        generated = []
        for _ in range(max_new):
            tokens = np.zeros((1, length), np.int32)
            tokens[0, :len(ids)] = ids
            padded = np.zeros((1, length, *positions.shape[1:]), np.int32)
            padded[0, :len(ids)] = positions
            logits = np.asarray(forward(params, tokens, padded, vision))[0, len(ids) - 1]
            token = int(np.argmax(np.where(np.arange(logits.shape[-1]) < VOCAB, logits, -np.inf)))
            generated.append(token)
            if token in stop_ids:
                break
            ids.append(token)
            positions = np.concatenate([positions, next_position(positions)[None]])
        out.append(generated)
    return out


def text_prompts(lengths, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [{"ids": rng.integers(8, VOCAB, n).astype(np.int32), "positions": np.arange(n, dtype=np.int32)}
            for n in lengths]


def image_prompt(cfg, before: int, after: int, seed: int):
    """Text, one image's slot run, text: M-RoPE positions from rope_index, patches as the processor lays them."""
    rng = np.random.default_rng(seed)
    slots = GRID[0] * GRID[1] * GRID[2] // cfg.vision.merge_size ** 2
    ids = np.concatenate([rng.integers(8, VOCAB, before), np.full(slots, IMAGE_PAD), rng.integers(8, VOCAB, after)])
    patch_positions, segments = mrope.vision_inputs([GRID], cfg.vision.merge_size)
    patches = rng.normal(size=(len(segments), cfg.vision.patch_dim)).astype(np.float32)
    return {"ids": ids.astype(np.int32), "positions": mrope.rope_index(ids, [GRID], IMAGE_PAD, -1, cfg.vision.merge_size),
            "vision": {"patches": patches, "patch_positions": patch_positions, "patch_segments": segments}}


@pytest.fixture(scope="module", params=[False, True], ids=["unscanned", "scanned"])
def text(request):
    return text_model(request.param)


@pytest.mark.heavy
def test_cached_greedy_equals_uncached_on_rows_of_different_lengths(text):
    graphdef, params = text
    prompts = text_prompts([3, 17, 9, 30, 1])
    reference = uncached_greedy(graphdef, params, prompts, NEW)
    assert len({tuple(row) for row in reference}) == len(prompts)  # a model that says something
    assert all(len(set(row)) > 2 for row in reference)
    assert generate_ids(params, graphdef, prompts, max_new_tokens=NEW, stop_ids=(), vocab=VOCAB) == reference
    # Smaller batches (one padding row in the last) change nothing.
    assert generate_ids(params, graphdef, prompts, max_new_tokens=NEW, stop_ids=(), vocab=VOCAB,
                        local_batch=2) == reference


@pytest.mark.heavy
def test_each_row_stops_at_its_own_stop_token_which_is_kept(text):
    graphdef, params = text
    prompts = text_prompts([5, 12, 8], seed=3)
    free = uncached_greedy(graphdef, params, prompts, NEW)
    stop = free[0][3]  # row 0 stops at its 4th token; the others where (if) they meet it
    reference = uncached_greedy(graphdef, params, prompts, NEW, stop_ids=(stop,))
    ours = generate_ids(params, graphdef, prompts, max_new_tokens=NEW, stop_ids=[stop], vocab=VOCAB)
    assert ours == reference
    assert ours[0] == free[0][:4] and ours[0][-1] == stop
    assert [len(r) for r in generate_ids(params, graphdef, prompts, max_new_tokens=3, stop_ids=[stop],
                                         vocab=VOCAB)] == [3, 3, 3]
    assert generate_ids(params, graphdef, prompts, max_new_tokens=0, stop_ids=[stop], vocab=VOCAB) == [[], [], []]


def test_prefill_logits_equal_the_full_forward_at_each_last_prompt_token(text):
    graphdef, params = text
    prompts = text_prompts([4, 11, 7], seed=5)
    tokens = np.zeros((3, 64), np.int32)
    lengths = np.array([len(p["ids"]) for p in prompts], np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, :lengths[row]] = prompt["ids"]
    positions = np.tile(np.arange(64, dtype=np.int32), (3, 1))
    model = nnx.merge(graphdef, params)
    logits, cache = model.prefill(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(lengths), 128)
    full = model(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray((positions < lengths[:, None]).astype(np.int32)))
    expected = np.asarray(full)[np.arange(3), lengths - 1]
    np.testing.assert_allclose(np.asarray(logits), expected, rtol=1e-5, atol=1e-5)
    assert cache.keys.shape == (3, 3, 2, 128, 8) and cache.keys.dtype == jnp.float32


@pytest.mark.heavy
def test_an_mrope_model_with_images_beside_text_rows():
    graphdef, params, cfg = vl_model()
    prompts = [image_prompt(cfg, 3, 5, seed=0), {**text_prompts([6], seed=1)[0]}, image_prompt(cfg, 9, 2, seed=2)]
    # Positions after the image's slots jump back (rope_index): max + 1 is not the prompt length.
    assert prompts[0]["positions"].max() + 1 < len(prompts[0]["ids"])
    reference = uncached_greedy(graphdef, params, [prompts[0], prompts[2]], NEW)
    text_reference = uncached_greedy(graphdef, params, [{**prompts[1], "positions": np.repeat(
        prompts[1]["positions"][:, None], 3, axis=1)}], NEW)
    ours = generate_ids(params, graphdef, prompts, max_new_tokens=NEW, stop_ids=(), vocab=VOCAB)
    assert ours == [reference[0], text_reference[0], reference[1]]
    # The image matters: other pixels give another continuation.
    other = dict(prompts[0], vision=dict(prompts[0]["vision"], patches=-prompts[0]["vision"]["patches"]))
    assert generate_ids(params, graphdef, [other], max_new_tokens=NEW, stop_ids=(), vocab=VOCAB)[0] != ours[0]


def test_buckets_and_bad_prompts():
    assert [bucket(n) for n in (1, 64, 65, 96, 97, 129, 200, 1000)] == [64, 64, 96, 96, 128, 192, 256, 1024]
    graphdef, params = text_model(False)
    with pytest.raises(ValueError, match=r"prompts\[1\]: ids must be a non-empty 1-D array"):
        generate_ids(params, graphdef, text_prompts([3]) + [{"ids": np.zeros(0, np.int32),
                                                             "positions": np.zeros(0, np.int32)}],
                     max_new_tokens=2, stop_ids=(), vocab=VOCAB)
    with pytest.raises(ValueError, match=r"prompts\[0\]: positions of shape \(4,\) for 3 ids"):
        generate_ids(params, graphdef, [{"ids": np.arange(3), "positions": np.arange(4)}], max_new_tokens=2,
                     stop_ids=(), vocab=VOCAB)
    with pytest.raises(ValueError, match="1 batches of 1 rows cannot hold 2 prompts"):
        generate_ids(params, graphdef, text_prompts([3, 4]), max_new_tokens=2, stop_ids=(), vocab=VOCAB,
                     local_batch=1, batches=1)


SHARDED = r"""
import json
import jax, numpy as np
from flax import nnx
from valen_jax.models import sharding
from valen_jax.decoding import Sampling, generate_ids
from tests.test_kv_cache import VOCAB, text_model, text_prompts

assert len(jax.devices()) == 8
graphdef, params = text_model(True)
mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
shardings = nnx.to_pure_dict(sharding.state_shardings(nnx.split(nnx.merge(graphdef, params))[1], mesh))
placed = jax.device_put(nnx.to_pure_dict(params), shardings)
prompts = text_prompts([3, 17, 9, 30, 1, 12])
local = jax.device_put(params, jax.devices()[0])
result = {}
for name, sampling in (("greedy", Sampling()), ("sampled", Sampling(temperature=1.0, top_k=20))):
    kwargs = dict(max_new_tokens=10, stop_ids=(), vocab=VOCAB, sampling=sampling, seed=3)
    with jax.set_mesh(mesh):
        ours = generate_ids(placed, graphdef, prompts, mesh=mesh, local_batch=8, batches=1, **kwargs)
    result[name] = [ours, generate_ids(local, graphdef, prompts, **kwargs)]
result["kv_heads_split"] = sorted({s.data.shape for s in placed["layers"]["attn"]["k"].addressable_shards})
print(json.dumps(result))
"""


@pytest.mark.heavy
def test_sharded_generation_on_eight_devices_equals_one_device():
    result = subprocess.run([sys.executable, "-c", SHARDED], cwd=ROOT, env=env_with_devices(8),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    for name in ("greedy", "sampled"):
        sharded, single = report[name]
        assert sharded == single, name
        assert len(sharded) == 6 and all(len(row) == 10 for row in sharded)
    # Parameters really are split: [layers, embed/fsdp, kv_heads/tensor, head_dim].
    assert report["kv_heads_split"] == [[3, 16, 1, 8]]

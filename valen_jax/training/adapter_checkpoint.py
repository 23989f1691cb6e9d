"""What a LoRA run's checkpoint holds: the trained leaves, their optimizer state, and the base's identity.

Under `config.model.lora` the base is frozen bit for bit (the step passes frozen leaves through, and
`set_to_zero` keeps no moments for them), so writing it at every step would store the same gigabytes
again and again. A checkpoint's `state.params` holds only the trained leaves (every adapter, the score
head, `lora.trainable`'s matches): the paths of its `state_layout`. Its meta records the base as
`lora_base`: `init_from` as the config gave it (path or hub name; "" for a fresh base), the seed the
fresh parts were drawn from, and a fingerprint of every frozen leaf as the model held it (imported,
extended with the added-token rows, NF4-quantised under QLoRA). A restore rebuilds the base the way
the run's start built it (`models.build.lora_base`), refuses it when a fingerprint differs (naming the
first differing leaf and both values), then puts the trained leaves in.

A fresh base (no `init_from`, or the fresh vision tower beside a text checkpoint) is drawn again from
the recorded seed rather than stored in the workdir: JAX's partitionable threefry gives the same values
on any mesh, so a restore on one device rebuilds what eight trained on, and the fingerprints turn any
drift (another JAX's random streams) into a refusal naming the JAX versions, never into another model.
Storing it would put a full copy of the weights in every LoRA workdir for the case (a LoRA on a model
trained from nothing) that matters least.

Why a fingerprint and not sha256: sha256 needs every byte on one host, so a 7B bf16 base (15 GB) would
be gathered off the devices and hashed on each restore, about 15 s at the 1 GiB/s this host hashes
(a pod first pulls the shards from every host); the fingerprint is two wrapping uint32 sums computed
where the shards lie (milliseconds, nothing gathered): of the words, and of each word hashed with its
position (murmur3's finaliser). Exact integer arithmetic, so the value is the same on every mesh; any
change confined to one word changes the first sum, and any other change (a permutation of words, which
leaves that sum alone, included) leaves the second unchanged with odds of 2⁻³² only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from valen_jax.training.checkpoint import CheckpointError, paths_of, words_of

# The `meta` key of a LoRA checkpoint's base record; a LoRA meta without it holds the base too (schema 2).
BASE_KEY = "lora_base"
FINGERPRINT = "uint32 sums of the words and of murmur3-fmix32(word ^ fmix32(index))"


def _mix(h):
    """murmur3's 32-bit finaliser: a bijection that spreads every input bit over the whole word."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _fingerprint(x):
    words = words_of(x)
    index = jnp.zeros(words.shape, jnp.uint32)
    for axis, size in enumerate(words.shape):  # the row-major position, wrapping like the sums
        index = index * jnp.uint32(size) + jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis)
    return jnp.stack([jnp.sum(words, dtype=jnp.uint32), jnp.sum(_mix(words ^ _mix(index)), dtype=jnp.uint32)])


_fingerprints = jax.jit(lambda tree: jax.tree.map(_fingerprint, tree))


def fingerprints(tree) -> dict[str, str]:
    """'/'-joined path → 16 hex digits, for every leaf of `tree` (computed on its devices)."""
    values = jax.device_get(_fingerprints(tree))
    return {path: f"{int(v[0]):08x}{int(v[1]):08x}" for path, v in zip(paths_of(tree), jax.tree.leaves(values),
                                                                         strict=True)}


def select(tree, keep) -> dict:
    """The leaves of the nested dict `tree` whose '/'-joined path `keep(path)` accepts, in its nesting."""
    def visit(node, prefix):
        out = {}
        for key, value in node.items():
            path = f"{prefix}{key}"
            if isinstance(value, dict):
                sub = visit(value, path + "/")
                if sub:
                    out[key] = sub
            elif keep(path):
                out[key] = value
        return out

    return visit(tree, "")


def trained_paths(frozen) -> set[str]:
    """The '/'-joined paths of the leaves `frozen` (a tree of bools like the params) leaves trainable."""
    return {path for path, f in zip(paths_of(frozen), jax.tree.leaves(frozen), strict=True) if not f}


def saved_paths(meta: dict) -> set[str]:
    """The params paths a LoRA checkpoint's state holds (its `state_layout` lines `params/PATH shape dtype`)."""
    return {line.split(" ", 1)[0][len("params/"):] for line in meta["state_layout"] if line.startswith("params/")}


def with_trained(params: dict, trained: dict) -> dict:
    """`params` with the leaves of `trained` (a subtree of the same nesting) in place of its own."""
    out = dict(params)
    for key, value in trained.items():
        out[key] = with_trained(params[key], value) if isinstance(value, dict) else value
    return out


def base_record(params: dict, trained: set[str], init_from: str, seed: int) -> dict:
    """meta[BASE_KEY] of a LoRA run whose params are `params`: the leaves outside `trained` are its base."""
    frozen = select(params, lambda path: path not in trained)
    return {"init_from": str(init_from), "seed": int(seed), "jax_version": jax.__version__,
            "fingerprint": FINGERPRINT, "leaves": fingerprints(frozen)}


def check_base(record: dict, params: dict, where: str) -> None:
    """Refuse (CheckpointError, one line) a rebuilt base whose frozen leaves are not those `record` names."""
    found = fingerprints(select(params, lambda path: path in record["leaves"]))
    source = (f"config.model.init_from={record['init_from']!r}" if record["init_from"] else
              f"the fresh base of seed {record['seed']} (drawn by JAX {record['jax_version']}, here {jax.__version__})")
    missing = sorted(set(record["leaves"]) - set(found))
    if missing:
        raise CheckpointError(f"{where}: the base rebuilt from {source} has no leaf {missing[0]} that the "
                              "adapters were trained on")
    for path, expected in record["leaves"].items():
        if found[path] != expected:
            raise CheckpointError(
                f"{where}: the base rebuilt from {source} differs from the one the adapters were trained on: "
                f"leaf {path} has fingerprint {found[path]}, the checkpoint recorded {expected}; put back the "
                "base they were trained on")

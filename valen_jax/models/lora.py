"""Low-rank adapters (LoRA, Hu et al. 2021) on the decoder's linear layers (and the vision tower's when
targeted), and QLoRA's quantised base.

A targeted weight W (say `layers/3/attn/q`, [D, N, H]) gains two parameters beside it: `q_lora_a`
[D, r] and `q_lora_b` [r, N, H], and the layer computes x·W + (alpha / r)·(x·A)·B (`layers.Attention` and
`layers.SwiGLU` call `delta`). A starts like PEFT's (uniform ±1/√fan_in), B at zero, so the adapted model
starts as the base. Their logical axes are W's input axes + `lora_rank`, and `lora_rank` + W's output axes,
so they shard like the weight they adapt (fsdp over `embed`, tensor over heads or mlp), and, being built
where W is, scanned layers stack them on the `layers` axis as they stack W.

A target is a decoder weight's name (`q`, ..., `down`: every decoder layer's) or `vision/` + a tower weight's
name (`vision/qkv`: every tower block's; `vision/merge_in`: the patch merger's), from the tower family's
own list (`VISION_LINEARS`): a name the model's tower lacks is refused naming config.model.lora.targets.
Without `vision/` targets the tower has no adapters and stays frozen, as before.

With `quantize_base="nf4"` every targeted decoder W is stored as NF4 codes + block absmax (`models/nf4.py`,
`NF4Weight`) and dequantised in the compute dtype in each forward: the frozen base of QLoRA.

Why our own and not `qwix.LoraProvider` (tried, qwix 0.1.8): qwix creates adapters by intercepting
`dot_general` during a first forward pass of one method (`__call__`) and finding the weight among the
calling module's attributes. On our decoder that first pass failed: unscanned with `TraceContextError`
(RngCount mutated across trace levels), scanned with an `IndexError`; and even working it would adapt
`__call__` only, not `hidden`/`prefill`/`decode_step`/`extend` that training and decoding call, and it
flattens our multi-axis weights so the adapters' logical axes would not be W's.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from valen_jax.errors import ConfigError
from valen_jax.models import nf4

# The decoder's linear layers an adapter can target, with the number of leading input axes of each
# weight (`layers.dense`'s in_dims): q, k, v [D, N|K, H]; o [N, H, D]; gate, up [D, F]; down [F, D].
DECODER = {"q": 1, "k": 1, "v": 1, "o": 2, "gate": 1, "up": 1, "down": 1}
ATTENTION, MLP = ("q", "k", "v", "o"), ("gate", "up", "down")
# The vision towers' own linear layers (qwen_vision: fused qkv [D, 3, N, H], proj [N, H, D], Qwen2-VL's
# fc1/fc2; both towers' merger merge_in/merge_out), targeted as VISION + name.
VISION = "vision/"
TOWER = {"qkv": 1, "proj": 2, "fc1": 1, "fc2": 1, "merge_in": 1, "merge_out": 1}
TARGETS = {**DECODER, **TOWER}  # in_dims of every weight an adapter can sit on
VISION_LINEARS = {  # each tower family's adaptable weights, blocks first, then the merger's
    "valen": (*ATTENTION, *MLP, "merge_in", "merge_out"),
    "qwen2_vl": ("qkv", "proj", "fc1", "fc2", "merge_in", "merge_out"),
    "qwen2_5_vl": ("qkv", "proj", *MLP, "merge_in", "merge_out"),
    "qwen3_vl": ("qkv", "proj", "fc1", "fc2", "merge_in", "merge_out"),
}
# Each target's dropout stream within a layer: the decoder's first, so their streams are those of before.
_STREAM = {name: index for index, name in enumerate(TARGETS)}
QUANTIZE_BASE = ("none", "nf4")
SUFFIX_A, SUFFIX_B = "_lora_a", "_lora_b"


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """config.model.lora as the model reads it (and the checkpoint meta records it)."""

    rank: int = 16
    alpha: float = 32.0
    targets: tuple[str, ...] = ATTENTION + MLP
    quantize_base: str = "none"
    # Regexes (full '/'-joined paths) of base parameters trained beside the adapters, e.g. a new head;
    # the score head, when the model has one, always trains (it starts fresh).
    trainable: tuple[str, ...] = ()
    # Dropout on each adapter's input (PEFT's lora_dropout), in training only: a step passes its key.
    dropout: float = 0.0
    # Set by `models.build` when the vision tower is fresh (not imported): it trains in full beside the
    # adapters, having nothing pretrained to keep (frozen at its random init it would be useless).
    train_vision: bool = False

    def __post_init__(self):
        object.__setattr__(self, "targets", tuple(self.targets))
        object.__setattr__(self, "trainable", tuple(self.trainable))
        names = (*DECODER, *dict.fromkeys(VISION + name for linears in VISION_LINEARS.values() for name in linears))
        unknown = [t for t in self.targets if t not in names]
        if unknown or not self.targets or len(set(self.targets)) != len(self.targets):
            raise ValueError(f"config.model.lora.targets={self.targets!r}: distinct names among {', '.join(names)}")
        if self.quantize_base not in QUANTIZE_BASE:
            raise ValueError(f"lora quantize_base={self.quantize_base!r}; choose one of {', '.join(QUANTIZE_BASE)}")
        if not (isinstance(self.rank, int) and self.rank >= 1):
            raise ValueError(f"lora rank must be an integer ≥ 1, got {self.rank!r}")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ValueError(f"lora dropout must be in [0, 1), got {self.dropout!r}")

    @property
    def vision_targets(self) -> tuple[str, ...]:
        return tuple(t[len(VISION):] for t in self.targets if t.startswith(VISION))

    def check_tower(self, vision) -> None:
        """Refuse `vision/` targets the model's tower (`vision`: its VisionConfig, or None) does not have, and
        adapters on a tower that trains in full anyway."""
        vision_targets = self.vision_targets
        if not vision_targets:
            return
        if vision is None:
            raise ConfigError(f"config.model.lora.targets={self.targets!r}: the model has no vision tower")
        missing = [name for name in vision_targets if name not in VISION_LINEARS[vision.family]]
        if missing:
            raise ConfigError(f"config.model.lora.targets={self.targets!r}: the {vision.family} vision tower has no "
                              f"{missing[0]!r}; its linear layers are "
                              f"{', '.join(VISION + n for n in VISION_LINEARS[vision.family])}")
        if self.train_vision:
            raise ConfigError(f"config.model.lora.targets={self.targets!r} names the vision tower, but it is fresh "
                              "(not imported) and trains in full: drop the vision/ targets")

    @property
    def scale(self) -> float:
        return float(self.alpha) / self.rank

    @classmethod
    def from_json(cls, data: dict | None) -> LoraConfig | None:
        return None if data is None else cls(**data)


def create(rngs: nnx.Rngs, name: str, shape, axes, rank: int, dtype) -> tuple[nnx.Param, nnx.Param]:
    """A, B of the adapter of weight `name` [shape] with logical `axes` (TARGETS gives its input axes)."""
    split = TARGETS[name]
    fan_in = math.prod(shape[:split])
    bound = 1.0 / math.sqrt(fan_in)  # PEFT: kaiming_uniform_(a=√5) on [r, in] gives ±1/√in
    a = jax.random.uniform(rngs.params(), (*shape[:split], rank), jnp.float32, -bound, bound).astype(dtype)
    b = jnp.zeros((rank, *shape[split:]), dtype)
    return (nnx.Param(a, logical_axes=(*axes[:split], "lora_rank")),
            nnx.Param(b, logical_axes=("lora_rank", *axes[split:])))


class NF4Weight(nnx.Module):
    """A frozen base weight held as NF4 (QLoRA). `codes` uint8 [size / 2], `absmax` f32 [size / 64]."""

    def __init__(self, shape, param_dtype, rngs: nnx.Rngs, where: str):
        nf4.check_quantisable(shape, where)
        size = math.prod(shape)
        self.shape = tuple(shape)
        # Placeholders: a quantised base is always made by `quantise_base` from float weights.
        self.codes = nnx.Param(jnp.zeros((size // 2,), jnp.uint8), logical_axes=("nf4",))
        self.absmax = nnx.Param(jnp.ones((size // nf4.BLOCK,), jnp.float32), logical_axes=("nf4",))


def delta(module, name: str, x, dense, scale: float, dtype, dropout: float = 0.0, key=None):
    """(alpha / r)·(drop(x)·A)·B of weight `name`'s adapter, or None when it has none. `key` (a training
    step's, per layer) draws the dropout mask of this adapter's input, each target its own stream as
    PEFT's separate dropout modules would; without a key (evaluation, decoding) there is no dropout."""
    a = getattr(module, name + SUFFIX_A, None)
    if a is None:
        return None
    if key is not None and dropout > 0:
        keep = jax.random.bernoulli(jax.random.fold_in(key, _STREAM[name]), 1.0 - dropout, x.shape)
        x = jnp.where(keep, x / jnp.asarray(1.0 - dropout, x.dtype), jnp.zeros((), x.dtype))
    low = dense(x, a[...].astype(dtype), in_dims=TARGETS[name])
    return dense(low, getattr(module, name + SUFFIX_B)[...].astype(dtype)) * jnp.asarray(scale, dtype)


def is_adapter(path: str) -> bool:
    return path.endswith((SUFFIX_A, SUFFIX_B))


def trainable_patterns(lora: LoraConfig, has_score_head: bool) -> tuple[str, ...]:
    """The param-group patterns of what trains under LoRA: every adapter, the named extras, the score head."""
    patterns = (rf".*(?:{SUFFIX_A}|{SUFFIX_B})", *lora.trainable)
    return patterns + (("score_head/.*",) if has_score_head else ()) + ((VISION + ".*",) if lora.train_vision else ())


def product(a, b, name: str):
    """A·B as W's shape (leading stacked axes, if any, kept): the update the adapter adds to W."""
    split = TARGETS[name]
    lead = a.ndim - split - 1
    a2 = a.reshape(*a.shape[:lead], math.prod(a.shape[lead:lead + split]), a.shape[-1])
    b2 = b.reshape(*b.shape[:lead], b.shape[lead], math.prod(b.shape[lead + 1:]))
    return (a2 @ b2).reshape(*a.shape[:-1], *b.shape[lead + 1:])


def merged(params: dict, cfg) -> dict:
    """The base-structure parameters (host numpy) of a LoRA model: W + (alpha/r)·A·B for every adapter, NF4
    weights dequantised, adapters dropped: what a plain model of `base_config(cfg)` loads."""
    lora = cfg.lora
    out = jax.tree.map(lambda x: np.asarray(jax.device_get(x)), params)

    def visit(node):
        for name in TARGETS:
            if isinstance(node.get(name), dict) and "codes" in node[name]:
                q = node[name]
                node[name] = np.asarray(_dequantise_stacked(q["codes"], q["absmax"], weight_shape(cfg, name)))
            if name + SUFFIX_A in node:
                a, b = node.pop(name + SUFFIX_A), node.pop(name + SUFFIX_B)
                w = node[name]
                update = product(a.astype(np.float32), b.astype(np.float32), name) * lora.scale
                node[name] = (w.astype(np.float32) + update).astype(w.dtype)
        for value in node.values():
            if isinstance(value, dict):
                visit(value)

    visit(out)
    return out


def weight_shape(cfg, name: str) -> tuple[int, ...]:
    """One layer's shape of decoder weight `name` (what an NF4 leaf dequantises to)."""
    d, n, k, h, f = cfg.dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
    return {"q": (d, n, h), "k": (d, k, h), "v": (d, k, h), "o": (n, h, d), "gate": (d, f), "up": (d, f),
            "down": (f, d)}[name]


def _dequantise_stacked(codes, absmax, shape):
    """codes [..., size/2] with any leading (stacked layer) axes → [..., *shape] f32."""
    fn = lambda c, m: nf4.dequantise(c, m, shape)  # noqa: E731
    for _ in range(codes.ndim - 1):
        fn = jax.vmap(fn)
    return fn(jnp.asarray(codes), jnp.asarray(absmax))


def base_config(cfg):
    """`cfg` without adapters: the model an export (or the HF import under a LoRA run) has."""
    return dataclasses.replace(cfg, lora=None)


def quantise_base(params: dict, cfg) -> dict:
    """The decoder's targeted float weights (`params["layers"]`, unscanned or stacked) replaced by NF4
    {codes, absmax}: QLoRA's frozen base from an imported or fresh float one. Traceable (jit it with the
    quantised model's shardings)."""
    names = cfg.lora.targets

    def visit(node):
        out = {}
        for key, value in node.items():
            if isinstance(value, dict):
                out[key] = visit(value)
            elif key in names and key in DECODER:
                leading = value.ndim - len(weight_shape(cfg, key))
                codes, absmax = nf4.quantise_stacked(value, leading)
                out[key] = {"codes": codes, "absmax": absmax}
            else:
                out[key] = value
        return out

    return {**params, "layers": visit(params["layers"])}


def adapter_tree(params: dict) -> dict:
    """The adapter leaves of a parameter tree (any leaves: arrays, shardings), in its nesting."""
    out = {}
    for key, value in params.items():
        if isinstance(value, dict):
            sub = adapter_tree(value)
            if sub:
                out[key] = sub
        elif str(key).endswith((SUFFIX_A, SUFFIX_B)):
            out[key] = value
    return out


def with_adapters(base: dict, adapter: dict) -> dict:
    """`base` with `adapter`'s leaves added beside the weights they adapt."""
    out = dict(base)
    for key, value in adapter.items():
        out[key] = with_adapters(base.get(key, {}), value) if isinstance(value, dict) else value
    return out

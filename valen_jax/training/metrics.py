"""Training metrics to `metrics.jsonl` and TensorBoard event files in the workdir; model FLOPs and MFU."""

from __future__ import annotations

import json
import logging
import math
import re
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from tensorboardX import SummaryWriter

from valen_jax.models.config import ModelConfig

log = logging.getLogger(__name__)

# Dense bf16 peak FLOP/s per chip from the vendors' datasheets (SXM parts for NVIDIA; sparsity
# excluded). First match wins, so "TPU v5 lite" (v5e) is tried before "TPU v5" (v5p).
PEAK_FLOPS = (
    (r"TPU v4", 275e12),
    (r"TPU v5 ?lite|TPU v5e", 197e12),
    (r"TPU v5p?", 459e12),
    (r"TPU v6 ?lite|TPU v6e", 918e12),
    (r"H200", 989e12),
    (r"H100", 989e12),
    (r"A100", 312e12),
)


class PeakFlopsError(ValueError):
    """No peak FLOP/s known for the device: MFU would be a guess, so config.train.peak_flops must say."""


def model_flops_per_step(cfg: ModelConfig, batch: int, seq: int, head_seq: int | None = None) -> float:
    """Decoder FLOPs of one training step: 6 per matmul parameter per token, plus causal attention.
    `head_seq`: the positions per row the output projection runs on, where fewer than `seq` (a
    reinforcement update projects only its completion window); all of them by default.

    Vision-tower FLOPs are not counted (they depend on each row's media), so MFU of a
    vision-language run slightly understates the work done.
    """
    attn = cfg.dim * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    mlp = 3 * cfg.dim * cfg.mlp_dim
    head_tokens = batch * (seq if head_seq is None else head_seq)
    return (6.0 * cfg.num_layers * (attn + mlp) * batch * seq + 6.0 * cfg.dim * cfg.vocab_size * head_tokens
            + attention_flops_per_step(cfg, batch, seq))


def attention_flops_per_step(cfg: ModelConfig, batch: int, seq: int) -> float:
    """The score and value products of causal attention in one training step (forward and backward)."""
    return cfg.num_layers * 6 * seq * cfg.num_heads * cfg.head_dim * batch * seq  # QK^T + AV, fwd+bwd, causal half


def measured_matmul_flops(dtype=jnp.float32, size: int | None = None, rounds: int | None = None) -> float:
    """FLOP/s of a square matmul on the default device in `dtype`: the CPU's "peak", which has no datasheet.
    The fastest of `rounds` timed calls after a compiling one: a mean over a few calls (as before) read
    the thread pool's wake-up and any other job's share of the CPU, and came out below what the train
    step itself reached (MFU 1.19 logged for an f32 run on 2 cores)."""
    on_cpu = jax.default_backend() == "cpu"
    size = size or (1024 if on_cpu else 4096)
    rounds = rounds or (10 if on_cpu else 20)
    a = jnp.ones((size, size), dtype)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    fastest = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        f(a).block_until_ready()
        fastest = min(fastest, time.perf_counter() - start)
    return 2 * size**3 / fastest


def peak_flops_per_device(configured: float | None, device: jax.Device | None = None, dtype=jnp.float32
                          ) -> tuple[float, str]:
    """(peak FLOP/s of one device, where the number came from); configured > 0 wins. On a CPU it is measured
    in `dtype`, the model's compute dtype (a CPU with bf16 instructions runs bf16 matmuls at another rate)."""
    if configured:
        return float(configured), "config.train.peak_flops"
    device = device or jax.devices()[0]
    if device.platform == "cpu":
        return measured_matmul_flops(dtype), f"a {jnp.dtype(dtype).name} matmul measured at start-up"
    for pattern, flops in PEAK_FLOPS:
        if re.search(pattern, device.device_kind):
            return flops, f"the datasheet table ({device.device_kind})"
    raise PeakFlopsError(f"no peak FLOP/s known for device kind {device.device_kind!r}; "
                         "set config.train.peak_flops (per device, FLOP/s)")


class MetricsLog:
    """Appends one JSON record per logged step; a resumed run first drops records past its start.

    A run killed after logging step s but before checkpointing it restarts from an earlier step
    and logs s again; dropping the stale tail keeps one record per step.
    """

    def __init__(self, workdir: str | Path, start_step: int = 0):
        self.enabled = jax.process_index() == 0
        if not self.enabled:
            return
        workdir = Path(workdir)
        path = workdir / "metrics.jsonl"
        if path.exists():
            self._truncate(path, start_step)
        self.jsonl = open(path, "a", encoding="utf-8")
        self.tensorboard = SummaryWriter(str(workdir / "tensorboard"), purge_step=start_step + 1)

    @staticmethod
    def _truncate(path: Path, start_step: int) -> None:
        lines = path.read_text(encoding="utf-8").splitlines()
        kept = []
        for number, line in enumerate(lines, 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if number == len(lines):  # a write cut short by a kill; nothing else can be half-written
                    log.warning("%s: dropping a truncated last line", path)
                    continue
                raise
            if record["step"] <= start_step:
                kept.append(line)
        if len(kept) != len(lines):
            staging = path.with_name(path.name + ".tmp")
            staging.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
            staging.replace(path)

    def write(self, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in values.items()}
        # JSON has no NaN or Infinity (Python's bare `NaN` breaks strict readers: jq, JavaScript, pandas'
        # engine="pyarrow"): a non-finite value is written as null and named in "nonfinite", so a reader
        # tells it from a metric that was not logged and still sees which way it went wrong.
        nonfinite = sorted(k for k, v in clean.items() if not math.isfinite(v))
        record = {"step": step, **{k: (None if k in nonfinite else v) for k, v in clean.items()},
                  **({"nonfinite": {k: str(clean[k]) for k in nonfinite}} if nonfinite else {})}
        self.jsonl.write(json.dumps(record, sort_keys=True, allow_nan=False) + "\n")
        self.jsonl.flush()
        for name, value in clean.items():
            if math.isfinite(value):
                self.tensorboard.add_scalar(name, value, step)

    def close(self) -> None:
        if self.enabled:
            self.jsonl.close()
            self.tensorboard.close()

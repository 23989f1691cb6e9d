"""AdamW with linear warmup then cosine or linear decay, clipped by global norm, with parameter groups.

Parameter groups (`config.train.param_groups`) select parameters by a regular expression that
must match the whole '/'-joined path (`embed`, `layers/0/attn/q`, `vision/patch_embed`); the
first matching group wins. A group is either `frozen` (no update, and no Adam moments held for
it: optax.multi_transform gives it `set_to_zero`) or has an `lr_multiplier` that scales the
schedule. A pattern that matches no parameter is an error: a typo must not freeze nothing.

Under LoRA (`config.model.lora`, `models/lora.py`) the configured groups come first, then implicit
ones: every adapter (`*_lora_a`, `*_lora_b`), each `config.model.lora.trainable` pattern and the score
head (when the model has one) train at the schedule's rate, a fresh vision tower (`LoraConfig.train_vision`,
set by `models.build`) at `config.train.vision_lr_multiplier` times it, as in a full run, and everything
else is frozen (`.*`), an imported vision tower included: the base gets no update and no moments.

Otherwise the vision tower (`vision/...`, when the model has one) trains at `config.train.vision_lr_multiplier`
times the schedule: an implicit group after the configured ones, so a configured group that matches
a tower parameter (freezing it, say) wins (`groups_of`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import jax
import optax

# The schema owns the config's vocabulary and its start-up checks (one declaration each).
from valen_jax.config.schema import DECAYS, check_param_groups
from valen_jax.errors import ParamGroupError  # its home; still importable from here
from valen_jax.models.lora import trainable_patterns

TRAINED = "trained"  # label of parameters in no group
FROZEN = "frozen"


def learning_rate_schedule(train_cfg) -> optax.Schedule:
    peak = float(train_cfg.learning_rate)
    warmup = int(train_cfg.warmup_steps)
    total = max(int(train_cfg.steps), warmup + 1)
    end = peak * float(train_cfg.end_learning_rate_fraction)
    if train_cfg.decay == "cosine":
        return optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=peak, warmup_steps=warmup,
                                                  decay_steps=total, end_value=end)
    if train_cfg.decay == "linear":
        return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup),
                                     optax.linear_schedule(peak, end, total - warmup)], [warmup])
    raise ValueError(f"config.train.decay={train_cfg.decay!r}; choose one of {', '.join(DECAYS)}")


def _decay_mask(params):
    # Norm scales and biases are not decayed: shrinking them towards zero only hurts.
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def path_of(key_path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in key_path)


def _label(path: str, groups: list[dict]) -> str:
    for index, group in enumerate(groups):
        if group["regex"].fullmatch(path):
            return FROZEN if group["frozen"] else f"group{index}"
    return TRAINED


def param_labels(params, groups: Sequence) -> dict:
    """The optimizer label of every parameter; errors on a group that matches nothing."""
    checked = check_param_groups(groups)
    paths = [path_of(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    for index, group in enumerate(checked):
        if not any(group["regex"].fullmatch(p) for p in paths):
            raise ParamGroupError(f"config.train.param_groups[{index}].pattern "
                                  f"{group['regex'].pattern!r} matches no parameter; paths look like "
                                  f"{', '.join(paths[:4])}")
    return jax.tree_util.tree_map_with_path(lambda p, _: _label(path_of(p), checked), params)


def frozen_mask(params, groups: Sequence):
    """True for frozen parameters (the step stops their gradient, so no backward pass is spent)."""
    return jax.tree.map(lambda label: label == FROZEN, param_labels(params, groups))


VISION_PATTERN = "vision/.*"


def _lora_groups(lora, params, vision_multiplier: float) -> list[dict]:
    """LoRA's implicit groups after the configured ones: what trains, then the frozen rest."""
    paths = [path_of(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    for index, pattern in enumerate(lora.trainable):
        if not any(re.fullmatch(pattern, p) for p in paths):
            raise ParamGroupError(f"config.model.lora.trainable[{index}] {pattern!r} matches no parameter; paths "
                                  f"look like {', '.join(paths[:4])}")
    has_head = any(p.startswith("score_head/") for p in paths)
    return [*({"pattern": pattern, "lr_multiplier": vision_multiplier if pattern == VISION_PATTERN else 1.0}
              for pattern in trainable_patterns(lora, has_head)),
            {"pattern": ".*", "frozen": True}]


def groups_of(train_cfg, params, lora=None) -> list[dict]:
    """The configured param groups, then LoRA's (`lora`: the model's LoraConfig) or else the vision tower's
    learning-rate group when the model has a tower (a drafter or a text model has none) and the multiplier
    is not 1."""
    groups = [dict(group) for group in train_cfg.param_groups]
    if lora is not None:
        if params is None:
            raise ValueError("groups_of: LoRA's groups need the parameter shapes")
        return groups + _lora_groups(lora, params, float(train_cfg.vision_lr_multiplier))
    multiplier = float(train_cfg.vision_lr_multiplier)
    if multiplier != 1.0 and params is not None and any(
            path_of(p).startswith("vision/") for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]):
        groups.append({"pattern": VISION_PATTERN, "lr_multiplier": multiplier})
    return groups


def build_optimizer(train_cfg, params=None, lora=None) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The optimizer and its base schedule; `params` (shapes suffice) is needed for param groups, LoRA
    (`lora`: the model's LoraConfig, or None) and the vision tower's learning rate."""
    schedule = learning_rate_schedule(train_cfg)

    def adamw(multiplier: float) -> optax.GradientTransformation:
        lr = schedule if multiplier == 1.0 else (lambda step: multiplier * schedule(step))
        return optax.adamw(lr, b1=float(train_cfg.adam_b1), b2=float(train_cfg.adam_b2),
                           weight_decay=float(train_cfg.weight_decay), mask=_decay_mask)

    clip = optax.clip_by_global_norm(float(train_cfg.grad_clip_norm))
    if train_cfg.param_groups and params is None:
        raise ValueError("build_optimizer: config.train.param_groups needs the parameter shapes")
    groups = groups_of(train_cfg, params, lora)
    if not groups:
        return optax.chain(clip, adamw(1.0)), schedule
    checked = check_param_groups(groups)
    transforms = {TRAINED: adamw(1.0), FROZEN: optax.set_to_zero()}
    for index, group in enumerate(checked):
        if not group["frozen"]:
            transforms[f"group{index}"] = adamw(group["lr_multiplier"])
    labels = param_labels(params, groups)
    used = set(jax.tree.leaves(labels))
    # multi_transform wants every label it is given to be used; drop the empty defaults.
    transforms = {k: v for k, v in transforms.items() if k in used}
    # Frozen gradients are zero (stopped in the step), so the global norm clipped here is that
    # of the trained parameters alone.
    return optax.chain(clip, optax.multi_transform(transforms, labels)), schedule

"""The train step as a pure function of (train state, batch), and the shardings it runs with."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from valen_jax import sharding
from valen_jax.losses import token_cross_entropy
from valen_jax.models.config import ModelConfig
from valen_jax.models.transformer import abstract_model


def vision_inputs(batch):
    return batch["patches"], batch["patch_positions"], batch["patch_segments"]


def forward_loss(graphdef, params, batch):
    model = nnx.merge(graphdef, params)
    logits = model(batch["tokens"], batch["positions"], batch["segment_ids"], vision_inputs(batch))
    loss_sum, weight_sum, correct = token_cross_entropy(logits, batch["targets"], batch["target_weights"])
    return loss_sum, weight_sum, correct


def make_train_step(graphdef, tx: optax.GradientTransformation, schedule: optax.Schedule) -> Callable:
    def loss_fn(params, batch):
        loss_sum, weight_sum, correct = forward_loss(graphdef, params, batch)
        # Mean over the global batch's supervised tokens; an all-zero batch gives loss 0, not NaN.
        denominator = jnp.maximum(weight_sum, 1.0)
        return loss_sum / denominator, {"accuracy": correct / denominator, "target_tokens": weight_sum}

    def train_step(state, batch):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], batch)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {"loss": loss, **aux, "grad_norm": optax.global_norm(grads),
                   "learning_rate": schedule(state["step"])}
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

    return train_step


class TrainLayout:
    """Abstract shapes and shardings of the train state and batch for one model on one mesh."""

    def __init__(self, model_cfg: ModelConfig, tx: optax.GradientTransformation, mesh: Mesh):
        self.mesh = mesh
        self.graphdef, abstract_state = abstract_model(model_cfg)
        self.param_shardings = nnx.to_pure_dict(sharding.state_shardings(abstract_state, mesh))
        self.param_shapes = nnx.to_pure_dict(abstract_state)
        replicated = NamedSharding(mesh, PartitionSpec())
        opt_shapes = jax.eval_shape(tx.init, self.param_shapes)
        opt_shardings = optax.tree_map_params(tx, lambda _, s: s, opt_shapes, self.param_shardings,
                                              transform_non_params=lambda _: replicated)
        self.state_shapes = {"params": self.param_shapes, "opt_state": opt_shapes,
                             "step": jax.ShapeDtypeStruct((), jnp.int32)}
        self.state_shardings = {"params": self.param_shardings, "opt_state": opt_shardings, "step": replicated}
        self.replicated = replicated

    def batch_shardings(self, batch_shapes: dict) -> dict:
        return {name: sharding.batch_sharding(self.mesh, len(shape.shape)) for name, shape in batch_shapes.items()}

    def abstract_state(self):
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            self.state_shapes, self.state_shardings)

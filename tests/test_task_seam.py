"""The Task seam (issue 26): a training mode is one task module plus its config, and the loop knows none.

A toy mode, a bigram language model that is not the project's decoder, is registered from this test
file alone and trained two steps by the real `train.run` on the chat smoke data, then resumed; the
loop and the command are read for mode branches.
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from configs import chat
from valen_jax import train
from valen_jax.config.schema import ConfigError
from valen_jax.models.build import model_config
from valen_jax.tasks import modes
from valen_jax.tasks.token_lm import token_assembly
from valen_jax.training import checkpoint
from valen_jax.training.optim import build_optimizer
from valen_jax.training.step import TrainLayout, compile_step
from valen_jax.training.task import Task

ROOT = Path(__file__).resolve().parent.parent


class Bigram(nnx.Module):
    """logits of the next token from the current one alone."""

    def __init__(self, vocab: int, dim: int, rngs: nnx.Rngs):
        self.embed = nnx.Param(jax.random.normal(rngs.params(), (vocab, dim)) * 0.02)
        self.head = nnx.Param(jax.random.normal(rngs.params(), (dim, vocab)) * 0.02)

    def __call__(self, tokens):
        return self.embed[...][tokens] @ self.head[...]


class BigramTask(Task):
    mode = "bigram"
    resume_checks: list = []

    @classmethod
    def open(cls, setup, train_set):
        return cls(setup, model_config(setup.config, setup.tokenizer), train_set)

    def _abstract(self):
        return nnx.split(nnx.eval_shape(lambda: Bigram(self.model_cfg.vocab_size, 8, nnx.Rngs(0))))

    def layout(self):
        graphdef, abstract = self._abstract()
        tx, schedule = build_optimizer(self.config.train, nnx.to_pure_dict(abstract))
        return TrainLayout(None, tx, self.setup.mesh, schedule, abstract=(graphdef, abstract))

    def assembly(self, spec):
        return token_assembly(self.config, self.train_set)

    def meta(self):
        return {"bigram": {"dim": 8}}

    def check_resume(self, step, saved):
        self.resume_checks.append((step, saved["bigram"]))

    def initial_params(self, layout):
        params = nnx.to_pure_dict(nnx.state(Bigram(self.model_cfg.vocab_size, 8, nnx.Rngs(int(self.config.train.seed)))))
        return jax.device_put(params, layout.param_shardings)

    def compile(self, layout, batch_shapes):
        def step(state, batch):
            def loss_of(params):
                logits = nnx.merge(layout.graphdef, params)(batch["tokens"])
                losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
                weights = batch["target_weights"]
                hits = (jnp.argmax(logits, -1) == batch["targets"]) * weights
                return jnp.sum(losses * weights) / jnp.sum(weights), jnp.sum(hits) / jnp.sum(weights)

            (loss, accuracy), grads = jax.value_and_grad(loss_of, has_aux=True)(state["params"])
            updates, opt_state = layout.tx.update(grads, state["opt_state"], state["params"])
            params = optax.apply_updates(state["params"], updates)
            return ({"params": params, "opt_state": opt_state, "step": state["step"] + 1},
                    {"loss": loss, "accuracy": accuracy})

        return compile_step(step, layout, batch_shapes)

    def flops_per_step(self):
        return 6.0 * 2 * self.model_cfg.vocab_size * 8 * self.config.data.global_batch * self.config.data.seq_len


@pytest.fixture
def bigram_mode(monkeypatch):
    monkeypatch.setitem(modes.MODES, "bigram", BigramTask.open)
    BigramTask.resume_checks = []


def _config(steps: int):
    config = chat.get_config("tiny")
    config.train.mode = "bigram"
    config.train.steps = steps
    config.train.checkpoint_every = 2
    config.train.log_every = 1
    config.eval.every = 0
    config.eval.at_end = False
    return config


@pytest.mark.slow
def test_a_registered_toy_mode_trains_two_steps_and_resumes_through_the_unchanged_loop(bigram_mode, tmp_path):
    first = train.run(_config(2), tmp_path)
    assert first["step"] == 2 and "report" not in first
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    mgr = checkpoint.manager(tmp_path, read_only=True)
    meta = checkpoint.restore_meta(mgr, 2)
    mgr.close()
    assert meta["bigram"] == {"dim": 8} and meta["config"]["train"]["mode"] == "bigram"
    vocab = meta["model"]["vocab_size"]
    assert {f"params/embed ({vocab}, 8) float32", f"params/head (8, {vocab}) float32"} <= set(meta["state_layout"])
    # A fresh bigram predicts near-uniformly: its first loss is ln(vocabulary), not the decoder's.
    assert rows[0]["loss"] == pytest.approx(math.log(vocab), rel=0.02)

    resumed = train.run(_config(3), tmp_path)
    assert resumed["step"] == 3
    assert BigramTask.resume_checks == [(2, {"dim": 8})]

    # The workdir knows its task: the decoder's config (train.mode=ar) on it is refused, naming both, before
    # anything there is written (issue 27).
    before = _tree_digest(tmp_path)
    other = _config(4)
    other.train.mode = "ar"
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"checkpoint 3 trains another task: train.mode='bigram' \(this config: 'ar'\); use "
                             "another --workdir"):
        train.run(other, tmp_path)
    assert _tree_digest(tmp_path) == before


def _tree_digest(root: Path) -> dict[str, str]:
    return {str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(root.rglob("*")) if path.is_file() and path.name != "train.lock"}


def test_an_unregistered_mode_is_refused_before_anything_is_written(tmp_path):
    config = _config(2)
    with pytest.raises(ConfigError, match="config.train.mode='bigram'; choose one of ar, vflash"):
        train.run(config, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def _mode_branches(path: Path) -> list[str]:
    """Lines of `path` that compare against a mode's name or ask for a data family."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            text = ast.unparse(node)
            if re.search(r"\bmode\b|vflash|valen|drafter", text):
                found.append(f"{path.name}:{node.lineno}: {text}")
        if isinstance(node, ast.Name) and node.id in ("is_valen", "DrafterConfig", "ValenAssembly"):
            found.append(f"{path.name}:{node.lineno}: {node.id}")
    return found


def test_the_loop_and_the_command_have_no_mode_branches():
    command, loop = ROOT / "valen_jax" / "train.py", ROOT / "valen_jax" / "training" / "loop.py"
    assert _mode_branches(command) + _mode_branches(loop) == []
    assert len(command.read_text().splitlines()) < 200
    # The checker finds a branch where there is one (a test of the test).
    assert _mode_branches(ROOT / "valen_jax" / "tasks" / "modes.py")

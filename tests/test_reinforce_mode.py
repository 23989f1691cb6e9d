"""Issue 32: the reinforcement mode (train.mode=reinforce) — its config checks and seed 003's refusals
before any device, the rollout rows and one update against hand-worked values, the model grader in the
rewards of a rollout, and (slow) the mode end to end, kill -9 resume bitwise, and the smoke check."""

from __future__ import annotations

import importlib.util
import json
import math
import signal
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import waiting
from tests.train_runs import ROOT, env_with_devices, final_params, metrics, run_train, train_command
from valen_jax.errors import ConfigError

TINY = "configs/reinforce.py:tiny"


def tiny_config():
    spec = importlib.util.spec_from_file_location("reinforce_config", ROOT / "configs/reinforce.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config("tiny")


def arithmetic(tmp_path: Path, train: int = 64, eval_: int = 8, max_operand: int = 10) -> tuple[Path, Path]:
    spec = importlib.util.spec_from_file_location("rl_arith_make", ROOT / "data/rl_arith/make.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    paths = []
    for name, rows in zip(("train", "eval"), make.make(train, eval_, seed=0, max_operand=max_operand), strict=True):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths.append(path)
    return paths[0], paths[1]


# ---- config and refusals, before any device ----------------------------------------------------------

def test_the_rl_group_belongs_to_the_reinforce_mode():
    from valen_jax.config.schema import validate_config
    from valen_jax.reinforce.settings import check_run

    config = tiny_config()
    validate_config(config)
    check_run(config)
    config.train.mode = "ar"
    with pytest.raises(ConfigError, match="config.rl is read only with config.train.mode=reinforce"):
        validate_config(config)
    config = tiny_config()
    del config["rl"]
    with pytest.raises(ConfigError, match="config.train.mode=reinforce needs a config.rl group"):
        validate_config(config)
    config = tiny_config()
    config.rl.typo = 1
    with pytest.raises(ConfigError, match="config.rl has unknown keys typo"):
        validate_config(config)
    config = tiny_config()
    config.data.global_batch = 8
    with pytest.raises(ConfigError, match="config.data.global_batch=8 must equal config.rl.prompts_per_rollout=4"):
        check_run(config)
    config = tiny_config()
    config.rl.max_new_tokens = config.data.seq_len
    with pytest.raises(ConfigError, match=f"config.rl.max_new_tokens={config.data.seq_len} leaves no room for a prompt"):
        check_run(config)


def test_seed_003_refusals_come_before_the_workdir_or_a_device(tmp_path):
    from valen_jax.train import run

    train, eval_ = arithmetic(tmp_path)
    config = tiny_config()
    config.data.train, config.data.eval = str(train), str(eval_)
    config.data.format = config.data.eval_format = "prepared"
    workdir = tmp_path / "run"
    with pytest.raises(ConfigError, match="config.data.format='prepared': a reinforcement run reads prompts"):
        run(config, workdir)
    assert not workdir.exists()

    config.data.format = config.data.eval_format = "chat"
    ok = train.read_text().splitlines()[0]
    bad = tmp_path / "images.jsonl"
    bad.write_text(ok + "\n" + json.dumps({"messages": [
        {"role": "user", "content": [{"type": "image", "path": "a.png"}, {"type": "text", "text": "2+2="}]},
        {"role": "assistant", "content": "4"}]}) + "\n")
    config.data.train = str(bad)
    with pytest.raises(ConfigError, match=rf"{bad}:2: message 0 holds an image; seed 003 refuses"):
        run(config, workdir)
    bad.write_text(ok + "\n" + json.dumps({"messages": [{"role": "user", "content": "2+2="}]}) + "\n")
    with pytest.raises(ConfigError, match=rf"{bad}:2: no assistant message, so no prompt to read"):
        run(config, workdir)
    assert not workdir.exists()


def test_the_smoke_check_refuses_prepared_rows_and_other_modes():
    from valen_jax.tasks.smoke_check import smoke_config

    config = tiny_config()
    config.data.format = config.data.eval_format = "prepared"
    with pytest.raises(ConfigError, match="config.data.format='prepared': a smoke check reads prompts"):
        smoke_config(config)
    config = tiny_config()
    config.train.mode = "ar"
    with pytest.raises(ConfigError, match="a smoke check samples and rewards completions"):
        smoke_config(config)
    smoke = smoke_config(tiny_config())
    assert smoke.train.steps == 1 and smoke.rl.inner_steps == 1 and smoke.data.global_batch == 2


# ---- the rollout and the update by hand --------------------------------------------------------------

def test_training_rows_mark_exactly_the_completion_targets():
    from valen_jax.reinforce.rollout import Rollout, training_rows

    prompts = [{"ids": np.array([5, 6, 7], np.int32), "positions": np.arange(3, dtype=np.int32)}]
    rollout = Rollout(prompts, [{"content": "x"}], completions=[[8, 9], [4]], texts=["a", "b"])
    rows = training_rows(rollout, group_size=2, seq_len=6, window=3)
    np.testing.assert_array_equal(rows["tokens"], [[5, 6, 7, 8, 9, 0], [5, 6, 7, 4, 0, 0]])
    # the window starts at the prompt's last token, whose next token is the completion's first: the
    # targets 8, 9 (row 0) and 4 (row 1) are the sampled tokens, the only ones the loss reads
    np.testing.assert_array_equal(rows["completion_start"], [2, 2])
    np.testing.assert_array_equal(rows["targets"], [[8, 9, 0], [4, 0, 0]])
    np.testing.assert_array_equal(rows["mask"], [[1, 1, 0], [1, 0, 0]])
    np.testing.assert_array_equal(rows["positions"], [[0, 1, 2, 3, 4, 0], [0, 1, 2, 3, 0, 0]])
    np.testing.assert_array_equal(rows["segment_ids"], [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])
    with pytest.raises(ValueError, match="rollout row 0: 2 completion tokens exceed the window of 1"):
        training_rows(rollout, group_size=2, seq_len=6, window=1)


@pytest.mark.slow
def test_one_update_is_the_clipped_loss_and_moves_towards_the_advantaged_completion():
    import optax
    from flax import nnx

    from data_pipeline.tokenizer import load_tokenizer
    from valen_jax.models.build import model_config
    from valen_jax.models.transformer import abstract_model
    from valen_jax.reinforce.objective import clipped_loss, token_log_probs
    from valen_jax.reinforce.update import make_log_probs, make_update
    from valen_jax.training.step import TrainLayout

    config = tiny_config()
    tokenizer = load_tokenizer(config.data.tokenizer, config.data.template_family)
    cfg = model_config(config, tokenizer)
    graphdef, _ = abstract_model(cfg)
    from valen_jax.models import sharding
    from valen_jax.models.build import init_params

    mesh = sharding.make_mesh(config.mesh)
    layout = TrainLayout(cfg, optax.sgd(0.01), mesh)
    with jax.set_mesh(mesh):
        params = init_params(cfg, 0, layout.param_shardings)
    tokens = jnp.array([[5, 6, 7, 8, 0, 0], [5, 6, 7, 9, 0, 0]], jnp.int32)
    # the window (3 positions from the prompt's last token, 2) reads the sampled tokens 8 and 9; its last
    # position (5) is past the rows' end
    batch = {"tokens": tokens, "positions": jnp.tile(jnp.arange(6), (2, 1)),
             "segment_ids": jnp.array([[1, 1, 1, 1, 0, 0]] * 2, jnp.int32),
             "completion_start": jnp.array([2, 2], jnp.int32), "targets": jnp.array([[8, 0, 0], [9, 0, 0]], jnp.int32),
             "mask": jnp.array([[1, 0, 0]] * 2, jnp.float32), "advantages": jnp.array([1.0, -1.0])}
    with jax.set_mesh(mesh):
        old = make_log_probs(graphdef, 1.0, None)(params, batch)
        # the window's log-probabilities are the whole sequence's at its positions, from the full logits
        full = token_log_probs(nnx.merge(graphdef, params)(tokens, batch["positions"], batch["segment_ids"]),
                               jnp.concatenate([tokens[:, 1:], jnp.zeros((2, 1), jnp.int32)], 1))
        state = {"params": params, "opt_state": optax.sgd(0.01).init(params), "step": jnp.zeros((), jnp.int32)}
        update = jax.jit(make_update(graphdef, optax.sgd(0.01), None, None, 0.2, 0.0, 1, 1.0, None))
        new_state, m = update(state, {**batch, "old_logp": old})
        new = make_log_probs(graphdef, 1.0, None)(new_state["params"], batch)
    assert old.shape == (2, 3)
    np.testing.assert_allclose(np.asarray(old[:, 0]), np.asarray(full[:, 2]), rtol=1e-5, atol=1e-6)
    # at the rollout's own params the ratio is 1: the loss is -mean(A) over the 2 completion tokens = 0
    expected, _ = clipped_loss(old, old, batch["advantages"], batch["mask"], 0.2)
    assert float(m["loss"]) == pytest.approx(float(expected), abs=1e-6) and float(m["clip_fraction"]) == 0.0
    assert int(new_state["step"]) == 0  # the run's step counts rollouts, not updates
    assert float(new[0, 0]) > float(old[0, 0])  # A = +1: the sampled token 8 became likelier
    assert float(new[1, 0]) < float(old[1, 0])  # A = -1: the sampled token 9 less likely

    # A rollout's first update without old_logp takes them from its own forward pass: the same update,
    # and the log-probabilities it returns are the rollout's, for the updates after it.
    with jax.set_mesh(mesh):
        state = {"params": params, "opt_state": optax.sgd(0.01).init(params), "step": jnp.zeros((), jnp.int32)}
        first_state, first = update(state, batch)
    np.testing.assert_allclose(np.asarray(first["old_logp"]), np.asarray(old), rtol=1e-6, atol=1e-6)
    assert float(first["loss"]) == pytest.approx(float(m["loss"]), abs=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7),
                 first_state["params"], new_state["params"])
    assert "old_logp" not in m  # given old_logp, nothing extra comes back


def test_the_model_grader_scores_a_rollout_beside_the_registry_rewards():
    from valen_jax.reinforce.rollout import Rollout, score

    class Tok:
        chat_template = "{{ messages }}"  # no known family: calls read as ChatML, as evaluate reads them

        def decode(self, ids, skip_special_tokens=True):
            return "2+2="

    asked = []

    def scripted(conversations):  # a grader that reads the completion out of its prompt
        asked.extend(conversations)
        return ["1" if "Completion:\n4\n" in c[1]["content"] else "0.5, close" if "Completion:\n5" in c[1]["content"]
                else "cannot say" for c in conversations]

    prompts = [{"ids": np.array([1, 2]), "positions": np.arange(2)}]
    rollout = Rollout(prompts, [{"content": "4", "tool_calls": []}], [[1], [2], [3]], ["4", "5", "x"])
    totals, each = score(rollout, {"exact": 1.0, "grader": 0.5}, group_size=3, tokenizer=Tok(), grader=scripted,
                         grader_instructions="Grade it.")
    assert each["exact"] == [1.0, 0.0, 0.0] and each["grader"] == [1.0, 0.5, 0.0]
    assert each["grader_unparsed"] == [1.0]
    np.testing.assert_allclose(totals, [1.5, 0.25, 0.0])
    assert asked[0][0] == {"role": "system", "content": "Grade it."} and "2+2=" in asked[0][1]["content"]


def test_rollout_seeds_depend_on_the_run_seed_and_step_only():
    from valen_jax.reinforce.settings import rollout_seed

    assert rollout_seed(0, 3) == rollout_seed(0, 3)
    assert len({rollout_seed(0, 3), rollout_seed(0, 4), rollout_seed(1, 3)}) == 3


# ---- end to end (subprocesses) -----------------------------------------------------------------------

def data_overrides(tmp_path: Path, max_operand: int = 10) -> tuple[str, ...]:
    train, eval_ = arithmetic(tmp_path, max_operand=max_operand)
    return (f"--config.data.train={train}", f"--config.data.eval={eval_}")


@pytest.mark.heavy
def test_the_mode_end_to_end_with_a_kl_reference_and_scanned_layers(tmp_path):
    workdir = tmp_path / "run"
    # Scanned layers: the rollouts decode a per-layer copy of the policy of the moment (`PerLayer`).
    result = run_train(TINY, workdir, *data_overrides(tmp_path), "--config.train.steps=2",
                       "--config.rl.kl_coef=0.05", "--config.eval.at_end=True", "--config.model.scan_layers=True")
    assert "rollouts decode the policy's 2 scanned layers laid out per layer" in result.stderr
    records = metrics(workdir)
    assert [r["step"] for r in records] == [1, 2]
    for key in ("loss", "kl", "clip_fraction", "reward/exact/mean", "reward/exact/std", "advantage/std",
                "completion_length/mean", "zero_variance_groups", "grad_norm"):
        assert all(math.isfinite(r[key]) for r in records), key
    assert records[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # the first update starts at the reference
    step, _ = final_params(workdir)
    assert step == 2
    report = json.loads((workdir / "eval" / "report-2.json").read_text())
    assert report["answer_exact_match"] is not None


STEPS = ("--config.train.steps=6", "--config.train.checkpoint_every=2", "--config.train.log_every=1")


@pytest.mark.heavy
def test_kill_9_then_resume_gives_the_uninterrupted_runs_parameters(tmp_path):
    # Operands 0-2 (answers -4..6) and a briefly supervised start: some completions earn a reward, so the
    # updates have a gradient and the resumed run must restore more than the weight decay.
    data = data_overrides(tmp_path, max_operand=3)
    sft = tmp_path / "sft"
    run_train("configs/reinforce.py:sft,tiny", sft, *data, "--config.train.steps=40",
              "--config.train.checkpoint_every=40", "--config.eval.at_end=False")
    start = (*data, *STEPS, f"--config.rl.from_workdir={sft}")
    reference = tmp_path / "reference"
    run_train(TINY, reference, *start)
    assert any(r["reward/std"] > 0 for r in metrics(reference)), "no rollout had a gradient to resume"

    killed = tmp_path / "killed"
    killed.mkdir()
    log = open(tmp_path / "killed.log", "w")
    process = subprocess.Popen(train_command(TINY, killed, *start), cwd=ROOT, env=env_with_devices(1),
                               stdout=log, stderr=subprocess.STDOUT, text=True)

    def logged() -> int:
        path = killed / "metrics.jsonl"
        return len(path.read_text().splitlines()) if path.exists() else 0

    assert waiting.until(lambda: logged() >= 3 and (killed / "checkpoints" / "2").is_dir(), process), \
        "the run ended before it could be killed"
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    assert logged() < 6, "the run finished before it was killed"

    result = run_train(TINY, killed, *start)
    assert "resumed from step" in result.stderr
    (step_a, params_a), (step_b, params_b) = final_params(reference), final_params(killed)
    assert step_a == step_b == 6
    for a, b in zip(params_a, params_b, strict=True):
        np.testing.assert_array_equal(a, b)
    assert [r["step"] for r in metrics(killed)] == list(range(1, 7))
    same = ("loss", "reward/mean", "completion_length/mean")
    assert [[r[k] for k in same] for r in metrics(killed)] == [[r[k] for k in same] for r in metrics(reference)]


@pytest.mark.heavy
def test_the_smoke_check_prints_its_findings_and_discards_its_workdir(tmp_path):
    workdir = tmp_path / "never-written"
    result = run_train(TINY, workdir, *data_overrides(tmp_path), "--smoke-check")
    assert "smoke check: 2 prompts × 4 completions sampled, rewarded and trained one update" in result.stdout
    assert "reward/exact/mean" in result.stdout and "sample: gold" in result.stdout
    assert "checkpoint written: True, discarded: True" in result.stdout
    assert not workdir.exists()
    # inner_steps=1: no update reads old log-probabilities, so the first update is the one program compiled
    assert "rl.inner_steps=1: every update is a rollout's first; one update program compiled" in result.stderr

"""Runs on registry references (seed 003, issue 17): resolved before any device is claimed, the exact
version and digest recorded in the checkpoint meta, a resumed run kept on the recorded version after
the alias moved; unknown references and format mismatches refused; evaluate accepts references."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from data_pipeline.registry import open_registry
from valen_jax.config.schema import ConfigError
from valen_jax.data.references import recorded_references, resolve_config_data

ROOT = Path(__file__).resolve().parent.parent
VALEN = ROOT / "data" / "smoke" / "valen"


def _config(registry: Path, train: str, eval_data: str | None = None, namespace: str = ""):
    sys.path.insert(0, str(ROOT))
    from configs import valen
    config = valen.get_config("tiny")
    config.data.registry = str(registry)
    config.data.namespace = namespace
    config.data.train = train
    if eval_data is not None:
        config.data.eval = eval_data
    return config


@pytest.fixture()
def registry(tmp_path):
    """smoke/valen v1 (the 4 text records, alias `cand`) and v2 (their first 3, `cand` moved there)."""
    reg = open_registry(str(tmp_path / "registry"))
    first = reg.register("smoke/valen", VALEN / "text.jsonl", "valen", alias="cand")
    lines = (VALEN / "text.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    (tmp_path / "three.jsonl").write_text("".join(lines[:3]), encoding="utf-8")
    return reg, first, tmp_path / "three.jsonl"


def test_references_resolve_in_place_and_are_recorded(registry, tmp_path):
    reg, first, _ = registry
    config = _config(tmp_path / "registry", "valen:cand", f"Smoke/Valen@{first.digest}", namespace="smoke")
    found = resolve_config_data(config, tmp_path / "run")
    assert config.data.train == config.data.eval == str(first.path)
    assert found["train"] == {"written": "valen:cand", "reference": "smoke/valen:v1", "version": 1,
                              "digest": first.digest, "format": "valen"}
    assert found["eval"]["reference"] == "smoke/valen:v1"
    plain = _config(tmp_path / "registry", str(VALEN / "train.jsonl"))
    assert resolve_config_data(plain, tmp_path / "run") == {} and plain.data.train == str(VALEN / "train.jsonl")


def test_unknown_reference_and_other_format_are_refused_naming_the_field(registry, tmp_path):
    with pytest.raises(ConfigError, match=r"config\.data\.train='smoke/valen:v9'"):
        resolve_config_data(_config(tmp_path / "registry", "smoke/valen:v9"), None)
    with pytest.raises(ConfigError, match="config.data.train='nowhere/valen'"):
        resolve_config_data(_config(tmp_path / "registry", "nowhere/valen"), None)
    config = _config(tmp_path / "registry", "smoke/valen:cand")
    config.data.format = "chat"
    with pytest.raises(ConfigError, match="registered as format 'valen'; the config reads it as 'chat'"):
        resolve_config_data(config, None)


def test_a_workdir_with_recorded_references_resolves_the_recorded_version(registry, tmp_path, caplog):
    reg, first, three = registry
    workdir = tmp_path / "run"
    found = resolve_config_data(_config(tmp_path / "registry", "smoke/valen:cand"), workdir)
    (workdir / "checkpoints" / "2" / "meta").mkdir(parents=True)
    (workdir / "checkpoints" / "2" / "meta" / "metadata").write_text(json.dumps({"data_references": found}))
    (workdir / "checkpoints" / "3.orbax-checkpoint-tmp-1").mkdir()  # a save under way is not read
    assert recorded_references(workdir) == found
    second = reg.register("smoke/valen", three, "valen")
    reg.set_alias("smoke/valen:cand", second.version)
    config = _config(tmp_path / "registry", "smoke/valen:cand")
    with caplog.at_level("INFO", logger="valen_jax.data.references"):
        again = resolve_config_data(config, workdir)
    assert again["train"] == found["train"] and config.data.train == str(first.path)
    assert "uses the recorded version smoke/valen:v1" in caplog.text and "now names smoke/valen:v2" in caplog.text
    # Another workdir follows the alias.
    assert resolve_config_data(_config(tmp_path / "registry", "smoke/valen:cand"), tmp_path / "new")["train"][
        "reference"] == "smoke/valen:v2"


def test_an_unknown_reference_is_refused_before_any_jax_backend_starts(registry, tmp_path):
    script = (
        "import sys; sys.path.insert(0, '.')\n"
        "from configs import valen\n"
        "from valen_jax import train\n"
        "from valen_jax.config.schema import ConfigError\n"
        "import jax._src.xla_bridge as xb\n"
        "config = valen.get_config('tiny')\n"
        f"config.data.registry = {str(tmp_path / 'registry')!r}\n"
        "config.data.train = 'smoke/valen:nope'\n"
        "try:\n"
        f"    train.run(config, {str(tmp_path / 'run')!r})\n"
        "except ConfigError as error:\n"
        "    print('refused:', error)\n"
        "print('backends initialised:', xb.backends_are_initialized())\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "refused: config.data.train='smoke/valen:nope'" in result.stdout
    assert "backends initialised: False" in result.stdout
    assert not (tmp_path / "run").exists()  # nothing written either


@pytest.mark.slow
def test_a_run_from_an_alias_resumes_on_the_recorded_version_after_the_alias_moved(registry, tmp_path):
    from tests.train_runs import run_train
    from valen_jax.training import checkpoint

    reg, first, three = registry
    workdir = tmp_path / "run"
    args = (f"--config.data.registry={tmp_path / 'registry'}", "--config.data.train=smoke/valen:cand",
            "--config.train.checkpoint_every=2", "--config.eval.at_end=False")
    run_train("configs/valen.py:tiny", workdir, *args, "--config.train.steps=2")
    second = reg.register("smoke/valen", three, "valen")
    reg.set_alias("smoke/valen:cand", second.version)
    resumed = run_train("configs/valen.py:tiny", workdir, *args, "--config.train.steps=4")
    assert "resumed from step 2" in resumed.stderr
    assert "uses the recorded version smoke/valen:v1" in resumed.stderr and "now names smoke/valen:v2" in resumed.stderr
    mgr = checkpoint.manager(workdir, read_only=True)
    for step in (2, 4):
        meta = checkpoint.restore_meta(mgr, step)
        assert meta["data_references"]["train"]["reference"] == "smoke/valen:v1"
        assert meta["data_references"]["train"]["digest"] == first.digest
        assert meta["shards"]["train"]["counts"]["records"] == 4  # v1's 4 records, not v2's 3


def test_evaluate_and_predict_data_references(registry, tmp_path):
    from valen_jax.data.references import resolve_cli_data

    reg, first, _ = registry
    assert resolve_cli_data(str(VALEN / "eval.jsonl"), str(tmp_path / "registry")) == (str(VALEN / "eval.jsonl"), None)
    path, record = resolve_cli_data("valen:cand", str(tmp_path / "registry"), "smoke")
    assert path == str(first.path) and record["reference"] == "smoke/valen:v1" and record["digest"] == first.digest
    with pytest.raises(SystemExit, match="--data=smoke/valen:v7"):
        resolve_cli_data("smoke/valen:v7", str(tmp_path / "registry"))

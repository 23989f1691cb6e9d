"""Checkpoints written before meta `schema_version` (issue 26 item 2) still restore, evaluate and resume.

`tests/fixtures/schema1/` holds a tiny VFlash target and its drafter, trained one step each by the code
of commit c3d16db (the last before the schema): `python -m valen_jax.train --config=configs/vflash.py:tiny`
with the model narrowed to dim 16 (`--config.model.dim=16 --config.model.mlp_dim=32
--config.model.num_layers=1 --config.model.num_heads=2 --config.model.num_kv_heads=1
--config.model.head_dim=8 --config.model.vision.dim=16 --config.model.vision.mlp_dim=32
--config.model.vision.num_heads=2`, one step, workdir /tmp/schema1/target), then `:tiny,drafter` against
it (/tmp/schema1/drafter), and that code's `evaluate --max_examples=4` report of the target on
data/smoke/vflash/eval.jsonl (`target-report.json`). Only `checkpoints/` and `tokenizer/` are kept.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import ml_collections
import pytest

from tests.fixture_runs import read_training_data_here
from valen_jax.evaluation.report import evaluate_workdir
from valen_jax.models import sharding
from valen_jax.run import check_target, target_record
from valen_jax.training import checkpoint
from valen_jax.vflash.task import restore_target

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "schema1"
EVAL = ROOT / "data" / "smoke" / "vflash" / "eval.jsonl"


@pytest.fixture
def runs(tmp_path):
    for name in ("target", "drafter"):
        shutil.copytree(FIXTURE / name, tmp_path / name)
    return tmp_path / "target", tmp_path / "drafter"


def _metas(workdir: Path) -> tuple[dict, dict]:
    """(the meta as written, as restore_meta gives it)."""
    raw = json.loads((workdir / "checkpoints" / "1" / "meta" / "metadata").read_text())
    mgr = checkpoint.manager(workdir, read_only=True)
    try:
        return raw, checkpoint.restore_meta(mgr, 1)
    finally:
        mgr.close()


def test_schema_1_metas_are_read_in_the_current_layout(runs):
    for workdir in runs:
        raw, meta = _metas(workdir)
        assert "schema_version" not in raw and meta["schema_version"] == checkpoint.META_SCHEMA
        assert {k: v for k, v in meta.items() if k != "schema_version"} == raw
    assert "params_sha256" in _metas(runs[1])[1]["drafter"]["target"]  # schema 1's record of the target


def _comparable(report: dict) -> dict:
    """The report without where the data was read from (the fixture's report ran in another checkout)."""
    report = json.loads(json.dumps(report))
    report.pop("data", None)
    for sample in report.get("samples", []):
        sample.pop("source", None)
    return report


TRAINED_ON = "/tmp/wt/data/smoke/vflash/recipe.json"  # the checkout the fixture was trained in (its meta says)


@pytest.mark.slow
def test_a_schema_1_target_evaluates_to_the_report_its_own_code_wrote(runs, monkeypatch):
    target, _ = runs
    read_training_data_here(monkeypatch, TRAINED_ON)
    report = evaluate_workdir(target, EVAL, max_examples=4)
    assert report["text_only_baseline"]["value"] is not None, report["text_only_baseline"]
    written = _comparable(json.loads((FIXTURE / "target-report.json").read_text()))
    # Every figure its own code wrote, to the digit; keys a later version adds (image_reliance's verdict and
    # margin, issue 55) are not the old code's to check.
    assert _as_written(_comparable(report), written) == written
    assert report["image_reliance"]["verdict"] in ("looks", "answers_from_text", "moves_without_improving")


def _as_written(report, written):
    """`report` with, in every dict, only the keys `written` holds there (a missing one stays missing)."""
    if isinstance(report, dict) and isinstance(written, dict):
        return {key: _as_written(report[key], written[key]) for key in written if key in report}
    if isinstance(report, list) and isinstance(written, list) and len(report) == len(written):
        return [_as_written(a, b) for a, b in zip(report, written, strict=True)]
    return report


def test_a_schema_1_drafter_is_checked_against_its_target_by_the_sha256_it_recorded(runs, caplog):
    target, drafter = runs
    _, meta = _metas(drafter)
    config = ml_collections.ConfigDict(meta["config"])
    config.model.target_from = str(target)  # the fixture's target, copied here from /tmp/schema1/target
    mesh = sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})
    found = restore_target(config, meta["tokenizer"]["fingerprint"], mesh)
    assert len(target_record(found)["params_identity"]) == 64 and found.step == 1
    check_target(drafter, 1, meta["drafter"]["target"], found)  # the same weights, moved: a warning, not a refusal
    assert "trained against the same target weights in /tmp/schema1/target" in caplog.text
    other = dataclasses.replace(found, params=jax.tree.map(lambda x: x * 2, found.params), identity="0" * 64)
    with pytest.raises(checkpoint.CheckpointError, match="is a drafter for target .*other weights"):
        check_target(drafter, 1, meta["drafter"]["target"], other)

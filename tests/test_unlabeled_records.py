"""Seed 000: "If a record has no labels at all, its media is never read" — in evaluation too; its
questions still count (as unlabeled) in the report, and prediction still answers them."""

from __future__ import annotations

import json

import pytest

from tests.smoke_workdirs import smoke_workdir
from tests.train_runs import ROOT

pytestmark = pytest.mark.heavy  # a tiny trained Valen workdir (shared with the evaluation tests)
VALEN_DATA = ROOT / "data/smoke/valen/train.jsonl"


@pytest.fixture(scope="module")
def valen_workdir(tmp_path_factory):
    return smoke_workdir(tmp_path_factory, "configs/valen.py:tiny")


def test_evaluation_never_reads_the_media_of_a_record_without_labels(valen_workdir, tmp_path, monkeypatch):
    from valen_jax.data import valen_rows
    from valen_jax.evaluate import evaluate_workdir

    records = [json.loads(line) for line in VALEN_DATA.read_text().splitlines() if line.strip()]
    with_media = [r for r in records if r.get("assets")]
    labeled, unlabeled = with_media[0], dict(with_media[1], targets={})
    # The assets resolve against the data file's folder: write beside the smoke set's assets.
    data = VALEN_DATA.parent / f"unlabeled-{tmp_path.name}.jsonl"
    data.write_text(json.dumps(labeled) + "\n" + json.dumps(unlabeled) + "\n", encoding="utf-8")
    read = []
    real = valen_rows.load_media

    def spy(example, spec, *args, **kwargs):
        read.append(example.meta["line"])
        return real(example, spec, *args, **kwargs)

    monkeypatch.setattr(valen_rows, "load_media", spy)
    try:
        report = evaluate_workdir(valen_workdir, data, fmt="valen")
    finally:
        data.unlink()
    assert read and set(read) == {1}  # line 2, the record without labels, was never laid out
    questions = len(labeled["request"]["questions"]) + len(unlabeled["request"]["questions"])
    assert report["questions"] == questions
    assert report["metrics"]["overall"]["unlabeled"] >= len(unlabeled["request"]["questions"])


def test_training_counts_and_reports_the_records_it_drops_for_having_no_labels(tmp_path):
    from tests.train_runs import run_train
    from valen_jax.training import checkpoint

    # Text records (no assets), one of them twice more without any label.
    records = [json.loads(line) for line in (ROOT / "data/smoke/valen/text.jsonl").read_text().splitlines()]
    unlabeled = [dict(records[0], targets={}), {k: v for k, v in records[1].items() if k != "targets"}]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records + unlabeled), encoding="utf-8")
    workdir = tmp_path / "run"
    held_out = ROOT / "data/smoke/valen/eval.jsonl"  # eval = train would be refused (seed 003 separation)
    result = run_train("configs/valen.py:tiny", workdir, f"--config.data.train={data}", f"--config.data.eval={held_out}",
                       "--config.train.steps=1", "--config.train.checkpoint_every=1", "--config.eval.at_end=False")
    assert "records without labels (never trained on, media not read): 2" in result.stdout
    assert "4 records with labels, 2 without" in result.stderr  # the start-up log line
    meta = checkpoint.restore_meta(checkpoint.manager(workdir, read_only=True), 1)
    assert meta["records_without_labels"] == 2

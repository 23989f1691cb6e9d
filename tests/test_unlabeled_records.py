"""Seed 000: "If a record has no labels at all, its media is never read" — in evaluation too; its
questions still count (as unlabeled) in the report, and prediction still answers them."""

from __future__ import annotations

import json

import pytest

from tests.smoke_workdirs import smoke_workdir
from tests.train_runs import ROOT

pytestmark = pytest.mark.slow  # a tiny trained Valen workdir (shared with the evaluation tests)
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

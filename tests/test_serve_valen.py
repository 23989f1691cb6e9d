"""`POST /v1/valen/score` (issue 31): seed-000 records in, the answer lines `python -m valen_jax.predict`
writes out, on a real server over the smoke Valen workdir; a model without a score head and a bad record
are JSON errors naming the field."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.serve_server import Served
from tests.smoke_workdirs import smoke_workdir
from tests.train_runs import ROOT
from valen_jax.predict import predict_workdir

VALEN_DATA = ROOT / "data/smoke/valen/train.jsonl"


@pytest.fixture(scope="module")
def valen_workdir(tmp_path_factory):
    return smoke_workdir(tmp_path_factory, "configs/valen.py:tiny")


@pytest.fixture(scope="module")
def served(valen_workdir):
    served = Served(valen_workdir, slots=2, max_queue=4)
    yield served
    served.close()


def text_records() -> list[dict]:
    """The smoke records without image assets (a request's records carry no files)."""
    records = [json.loads(line) for line in VALEN_DATA.read_text().splitlines() if line.strip()]
    return [r for r in records if not r.get("assets")]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["question", "shared_state"])
def test_scores_equal_predicts_answer_lines(served, valen_workdir, tmp_path, mode):
    records = text_records()
    assert len(records) >= 2
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    want_mode, want = predict_workdir(valen_workdir, rows, mode=mode)
    response = httpx.post(served.url + "/v1/valen/score", timeout=300,
                          json={"model": served.service.name, "records": records, "mode": mode})
    assert response.status_code == 200, response.text
    got = response.json()
    assert got["mode"] == want_mode == mode
    assert got["data"] == json.loads(json.dumps(want))  # the very lines predict writes (JSON round trip)
    assert [line["record_id"] for line in got["data"]] == [r["meta"]["record_id"] for r in records]


@pytest.mark.slow
def test_a_bad_record_names_its_field(served):
    record = text_records()[0]
    bad = dict(record, request=dict(record["request"], questions={}))
    response = httpx.post(served.url + "/v1/valen/score", timeout=300,
                          json={"model": served.service.name, "records": [record, bad]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].startswith("records[1]"), error
    assert error["message"].startswith(error["param"])

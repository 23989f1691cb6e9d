"""evaluate and predict as users run them: CLIs in subprocesses against tiny trained workdirs."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from tests.smoke_workdirs import smoke_workdir
from tests.train_runs import ROOT, env_with_devices, run_module

pytestmark = pytest.mark.heavy
VALEN_DATA = ROOT / "data/smoke/valen/train.jsonl"


@pytest.fixture(scope="module")
def valen_workdir(tmp_path_factory):
    return smoke_workdir(tmp_path_factory, "configs/valen.py:tiny")


def _cli(module: str, *args: str) -> str:
    return run_module(module, *args).stdout


def _labels() -> list[dict]:
    """Per record: {question id: (type, label dict or None)} straight from the JSONL."""
    out = []
    for line in VALEN_DATA.read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        targets = record.get("targets") or {}
        questions = {}
        for qid, question in record["request"]["questions"].items():
            target = targets.get(qid)
            probs = None if target is None else target.get("probabilities")
            questions[qid] = (question["type"], probs)
        out.append({"record_id": record["meta"]["record_id"], "group_id": record["group_id"], "questions": questions})
    return out


def _recompute(answers: list[dict], labels: list[dict]) -> dict:
    """The notebook's formulas, in independent numpy code."""
    ce, brier, rps, hard_rows, labeled, score_labeled, unlabeled, soft = [], [], [], [], 0, 0, 0, 0
    for answer, record in zip(answers, labels, strict=True):
        assert answer["record_id"] == record["record_id"] and answer["group_id"] == record["group_id"]
        assert set(answer["answers"]) == set(record["questions"])
        for qid, (qtype, label) in record["questions"].items():
            predicted = answer["answers"][qid]["probabilities"]
            if label is None:
                unlabeled += 1
                continue
            keys = list(predicted)
            q = np.array([predicted[k] for k in keys], np.float64)
            p = np.array([label[k] for k in keys], np.float64)
            labeled += 1
            ce.append(-np.sum(p * np.log(np.maximum(q, 1e-12))))
            brier.append(np.sum((q - p) ** 2))
            if qtype == "score":
                score_labeled += 1
                rps.append(np.sum((np.cumsum(q) - np.cumsum(p)) ** 2) / (len(q) - 1))
            if np.count_nonzero(p) == 1 and p.max() == 1.0:
                hard_rows.append((q.max(), float(np.argmax(q) == np.argmax(p))))
            else:
                soft += 1
    conf = np.array([c for c, _ in hard_rows])
    hit = np.array([h for _, h in hard_rows])
    bins = np.minimum(np.floor(conf * 10).astype(int), 9)
    ece = sum(abs(np.sum(hit[bins == b] - conf[bins == b])) for b in range(10)) / len(hard_rows)
    return {"accuracy": hit.mean(), "cross_entropy": np.mean(ce), "brier": np.mean(brier), "rps": np.mean(rps),
            "ece": ece, "labeled": labeled, "unlabeled": unlabeled, "soft_labeled": soft,
            "hard_labeled": len(hard_rows), "score_labeled": score_labeled}


@pytest.mark.parametrize("mode", ["question", "shared_state"])
def test_valen_report_is_recomputable_from_the_answers_and_the_labels(valen_workdir, tmp_path, mode):
    answers_path, report_path = tmp_path / "answers.jsonl", tmp_path / "report.json"
    out = _cli("valen_jax.predict", f"--workdir={valen_workdir}", f"--data={VALEN_DATA}",
               f"--output={answers_path}", f"--mode={mode}")
    assert f"6 records, 15 questions answered ({mode} mode)" in out
    _cli("valen_jax.evaluate", f"--workdir={valen_workdir}", f"--data={VALEN_DATA}", f"--output={report_path}",
         f"--mode={mode}")
    answers = [json.loads(line) for line in answers_path.read_text().splitlines()]
    report = json.loads(report_path.read_text())
    labels = _labels()
    assert report["mode"] == mode and report["step"] == 4 and report["examples"] == 6

    # Every question answered, labeled or not, in the record's candidate order.
    records = [json.loads(line) for line in VALEN_DATA.read_text().splitlines() if line.strip()]
    for answer, record in zip(answers, records, strict=True):
        for qid, question in record["request"]["questions"].items():
            got = answer["answers"][qid]
            keys = {"choice": lambda q: list(q["criteria"]), "noul": lambda q: ["true", "false"],
                    "score": lambda q: [str(k) for k in range(len(q["criteria"]))]}[question["type"]](question)
            assert list(got["probabilities"]) == keys and got["type"] == question["type"]
            q = np.array(list(got["probabilities"].values()))
            assert math.isclose(q.sum(), 1.0, abs_tol=1e-9) and got["argmax"] == keys[int(np.argmax(q))]
            if question["type"] == "score":
                assert got["expected"] == pytest.approx(float(np.dot(np.arange(len(q)), q)))
                assert 0.0 <= got["expected"] <= len(q) - 1
            else:
                assert "expected" not in got

    expected = _recompute(answers, labels)
    overall = report["metrics"]["overall"]
    for key in ("accuracy", "cross_entropy", "brier", "rps", "ece"):
        assert overall[key] == pytest.approx(expected[key], abs=1e-6), key
        assert report[key] == overall[key]
    for key in ("labeled", "unlabeled", "soft_labeled", "hard_labeled"):
        assert overall[key] == expected[key], key
    assert (overall["questions"], overall["labeled"], overall["unlabeled"]) == (15, 13, 2)  # seed 000 smoke set
    assert set(report["metrics"]["by_type"]) == {"choice", "noul", "score"}
    by_domain = report["metrics"]["by_domain"]
    assert sum(d["questions"] for d in by_domain.values()) == 15
    assert set(report["metrics"]["by_modality"]) >= {"text"}
    noul = overall["noul_confusion"]
    assert sum(n for row in noul.values() for n in row.values()) == report["metrics"]["by_type"]["noul"]["hard_labeled"]


def test_valen_evaluate_defaults_to_the_checkpoint_mode_and_format(valen_workdir, tmp_path):
    out = _cli("valen_jax.evaluate", f"--workdir={valen_workdir}", f"--data={VALEN_DATA}",
               f"--output={tmp_path / 'r.json'}", "--step=4")
    assert "question mode" in out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["format"] == "valen" and report["task"] == "valen"


def test_vflash_report_keeps_its_keys_and_adds_primitive_metrics(tmp_path_factory, tmp_path):
    workdir = smoke_workdir(tmp_path_factory, "configs/vflash.py:tiny")
    report_path = tmp_path / "report.json"
    out = _cli("valen_jax.evaluate", f"--workdir={workdir}", f"--data={ROOT / 'data/smoke/vflash/eval.jsonl'}",
               f"--output={report_path}", "--max_examples=8", "--max_new_tokens=8")
    assert "primitive parse rate" in out
    report = json.loads(report_path.read_text())
    assert report["examples"] == 8 and report["examples_in_data"] == 16 and report["target_tokens"] > 0
    assert report["loss"] > 0 and 0.0 <= report["accuracy"] <= 1.0
    assert 0.0 <= report["generation"]["primitive_parse_rate"] <= 1.0
    overall = report["metrics"]["overall"]
    assert overall["answers"] == 8
    assert set(overall) >= {"point", "box", "robot_2d", "robot_3d", "drive", "dense", "well_formed_rate"}
    assert overall["point"]["reference"] + overall["box"]["reference"] > 0
    assert list(report["metrics"]["by_entry"]) == ["eval"]
    assert len(report["samples"]) == 8 and report["samples"][0]["image"].endswith(".png")


def test_chat_report_has_token_metrics_and_tool_call_match(tmp_path_factory, tmp_path):
    workdir = smoke_workdir(tmp_path_factory, "configs/chat.py:tiny", "--config.train.steps=4")
    report_path = tmp_path / "report.json"
    _cli("valen_jax.evaluate", f"--workdir={workdir}", f"--data={ROOT / 'data/smoke/chat/eval.jsonl'}",
         f"--output={report_path}", "--max_new_tokens=4")
    report = json.loads(report_path.read_text())
    overall = report["metrics"]["overall"]
    assert report["format"] == "chat" and report["target_tokens"] == overall["tokens"] > 0
    assert report["loss"] == pytest.approx(overall["token_loss"]) and overall["perplexity"] > 1
    # The smoke eval set holds 3 assistant messages with tool calls; a 4-step model matches none.
    assert overall["messages"] == 3 and overall["tool_calls"]["reference"] == 3
    assert report["tool_call_exact_match"] == overall["exact_match"] == 0.0
    assert list(report["metrics"]["by_locale"]) == ["(missing)"] == list(report["metrics"]["by_source"])


def test_a_choice_question_with_one_candidate_evaluates(valen_workdir, tmp_path):
    # Seed 000 allows 1–255 choice candidates; the reader accepted one, the metrics used to refuse it.
    record = json.loads(VALEN_DATA.read_text().splitlines()[0])
    record["request"]["questions"]["color"]["criteria"] = {"green": "Green light"}
    record["targets"]["color"] = {"probabilities": {"green": 1.0}}
    data = tmp_path / "one_candidate.jsonl"
    data.write_text(json.dumps(record) + "\n", encoding="utf-8")
    from valen_jax.evaluate import evaluate_workdir
    report = evaluate_workdir(valen_workdir, data, fmt="valen")
    choice = report["metrics"]["by_type"]["choice"]
    assert (choice["questions"], choice["hard_labeled"], choice["accuracy"]) == (1, 1, 1.0)
    assert choice["cross_entropy"] == pytest.approx(0.0, abs=1e-9) and choice["ece"] == pytest.approx(0.0, abs=1e-9)
    assert report["questions"] == 3 and report["metrics"]["by_type"]["noul"]["questions"] == 1


FSDP_SCRIPT = r"""
import json, sys
import jax, numpy as np
from valen_jax.training import checkpoint
from valen_jax.evaluation import tokens, workdir as eval_workdir
from valen_jax.run import restore_model

workdir, data = sys.argv[1], sys.argv[2]
saved_meta = checkpoint.restore_meta


def trained_with_fsdp(mgr, step):
    # The smoke workdir trained on one device; its saved config now says what a model too big for
    # one device would have trained with.
    meta = saved_meta(mgr, step)
    meta["config"]["mesh"] = {"data": -1, "fsdp": 4, "tensor": 2}
    return meta


checkpoint.restore_meta = trained_with_fsdp
out = {}
for name, devices in (("eight", None), ("one", jax.devices()[:1])):
    restored = restore_model(workdir, devices=devices)
    fmt, options = eval_workdir.data_format(restored, None)
    with jax.set_mesh(restored.mesh):
        examples, _, _ = eval_workdir.load_examples(fmt, data, restored.workdir, checkpoint.tokenizer_dir(workdir),
                                                    restored.fingerprint, options, 6)
        forced = tokens.teacher_forced(restored.params, restored.graphdef, examples, restored.spec, restored.mesh, 4)
    leaves = jax.tree.leaves(restored.params)
    out[name] = {"mesh": dict(restored.mesh.shape), "embed": str(restored.params["embed"].sharding.spec),
                 "largest_shard": max(a.addressable_shards[0].data.size / a.size for a in leaves if a.size >= 4096),
                 "forced": forced}
print(json.dumps(out))
"""


def test_a_model_trained_with_fsdp_is_sharded_the_same_way_at_evaluation(tmp_path_factory):
    workdir = smoke_workdir(tmp_path_factory, "configs/vflash.py:tiny")
    result = subprocess.run([sys.executable, "-c", FSDP_SCRIPT, str(workdir), str(ROOT / "data/smoke/vflash/eval.jsonl")],
                            cwd=ROOT, env=env_with_devices(8), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["eight"]["mesh"] == {"data": 1, "fsdp": 4, "tensor": 2}
    assert out["one"]["mesh"] == {"data": 1, "fsdp": 1, "tensor": 1}  # fitted to the devices given
    assert "fsdp" in out["eight"]["embed"] and out["eight"]["largest_shard"] <= 0.5  # not replicated whole
    eight, one = out["eight"]["forced"], out["one"]["forced"]
    assert eight["target_tokens"] == one["target_tokens"] > 0
    assert eight["loss"] == pytest.approx(one["loss"], rel=1e-5)
    assert eight["accuracy"] == pytest.approx(one["accuracy"], abs=1e-9)


@pytest.mark.parametrize("config", ["configs/vflash.py:tiny", "configs/valen.py:tiny"])
def test_training_eval_and_the_end_of_run_report_are_one_path(tmp_path_factory, config):
    # Training's eval.every and its eval.at_end report on the same params and examples: the same
    # numbers from the same compiled function, not two formulas (Valen: the per-question metrics).
    import dataclasses

    import jax

    from valen_jax.evaluate import evaluate_params
    from valen_jax.evaluation.periodic import PeriodicEval
    from valen_jax.run import restore_model

    restored = restore_model(smoke_workdir(tmp_path_factory, config))
    restored.config.eval.max_examples, restored.config.eval.max_new_tokens = 4, 2
    periodic = PeriodicEval(dataclasses.replace(restored, params=None))(restored.params)
    with jax.set_mesh(restored.mesh):
        report = evaluate_params(restored, restored.config.data.eval)
    assert report["examples"] == 4
    keys = ("accuracy", "cross_entropy", "brier", "ece") if report["format"] == "valen" else (
        "target_tokens", "loss", "accuracy")
    assert {f"eval_{k}": report[k] for k in keys}.items() <= periodic.items()
    if report["format"] == "valen":
        assert "eval_image_loss_gap" not in periodic
    else:  # the smoke eval records all hold an image of one size: every one is compared
        assert periodic["eval_loss_with_images"] == pytest.approx(report["loss"], rel=1e-6)
        # Swapped images are a different input: a loss equal to the bit means nothing was swapped.
        assert periodic["eval_loss_swapped_images"] != periodic["eval_loss_with_images"]
        assert periodic["eval_image_loss_gap"] == pytest.approx(
            periodic["eval_loss_swapped_images"] - periodic["eval_loss_with_images"])

"""`valen_jax.regenerate` (issue 16): a VFlash dataset rewritten with the target's own answers.

One target (120 steps on the smoke boxes file: its greedy answers are a mix of well-formed boxes,
malformed ones and answers longer than the budget) regenerates boxes.jsonl (multi-turn records) once,
with one sampled variant per record; the tests read that one output. It is not the suite's shared tiny
VFlash target (tests/smoke_workdirs.py, 4 steps on the whole recipe, which the speculative-evaluation and
drafter tests share): with that one, regenerate skips every record and variant of boxes.jsonl (40 skips)
and writes nothing to check.
"""

from __future__ import annotations

import json

import pytest

from data_pipeline.validate import validate
from tests.train_runs import ROOT, run_train
from valen_jax.decoding.sampling import Sampling
from valen_jax.evaluation import answers
from valen_jax.generate import generate_workdir
from valen_jax.vflash import regenerate as regen_module

BOXES = ROOT / "data/smoke/vflash/boxes.jsonl"
MAX_NEW_TOKENS = 24  # short enough that some multi-box answers do not finish


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("regenerate") / "target"
    run_train("configs/vflash.py:tiny", workdir, "--config.train.steps=120", "--config.train.checkpoint_every=120",
              "--config.train.learning_rate=1e-2", "--config.train.warmup_steps=10", "--config.train.log_every=40",
              "--config.eval.at_end=False", f"--config.data.train={BOXES}", "--config.data.format=vflash")
    return workdir


@pytest.fixture(scope="module")
def regenerator(target):
    return regen_module.Regenerator(target, max_new_tokens=MAX_NEW_TOKENS, batch_size=8,
                                    sampling=Sampling(temperature=1.0), seed=3)


@pytest.fixture(scope="module")
def regenerated(regenerator, tmp_path_factory):
    output = tmp_path_factory.mktemp("regenerated") / "boxes-regen"
    report = regen_module.regenerate(regenerator, BOXES, output, samples=1)
    return output, report


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _greedy_rows(output):
    """(source line, record) of each written greedy record: rows are each source record then its variant,
    minus the skipped ones (regenerate.json lists them)."""
    info = json.loads((output / "regenerate.json").read_text())
    skipped = {(s["source"], s["variant"]) for s in info["skipped"]}
    order = [(f"{BOXES}:{n}", v) for n in range(1, 21) for v in (0, 1)]
    kept = [key for key in order if key not in skipped]
    records = _rows(output / "boxes.jsonl")
    assert len(records) == len(kept)
    return [(source, record) for (source, variant), record in zip(kept, records, strict=True) if variant == 0]


@pytest.mark.heavy
def test_answers_are_the_targets_greedy_answers(regenerated, target, tmp_path):
    output, report = regenerated
    greedy = _greedy_rows(output)
    assert greedy, "the target wrote no answer the reader accepts: the test would check nothing"
    assert any(len(record["conversations"]) > 2 for _, record in greedy), "no multi-turn record kept"
    # Answer k was generated after answers 0..k-1 as written here (chained), so `generate` on the output
    # reproduces every answer of a greedy record; answer 0's prompt is the source's, so it is also
    # generate's answer on the source data.
    folder = tmp_path / "greedy"  # the greedy records alone, their images where the source's are
    folder.mkdir()
    (folder / "greedy.jsonl").write_text("".join(json.dumps(record) + "\n" for _, record in greedy))
    (folder / "recipe.json").write_text(json.dumps({"greedy": {"annotation": "greedy.jsonl",
                                                               "root": str(BOXES.parent)}}))
    lines = generate_workdir(target, folder / "recipe.json", fmt="recipe", max_new_tokens=MAX_NEW_TOKENS,
                             batch_size=8)
    for line in lines:
        source, record = greedy[line["index"]]
        assert line["finish_reason"] == "stop", source
        assert line["text"] == record["conversations"][2 * line["answer"] + 1]["value"], (source, line["answer"])
    assert len(lines) == sum(len(r["conversations"]) // 2 for _, r in greedy)


@pytest.mark.heavy
def test_skips_are_counted_with_reasons_and_the_output_validates(regenerated):
    output, report = regenerated
    assert report.records == 20 and report.written + len({(s.source, s.variant) for s in report.skips}) == 40
    kinds = {s.reason.split(":")[0] for s in report.skips}
    assert {"unfinished", "refused by the VFlash reader"} <= kinds, kinds
    for s in report.skips:
        assert s.source.startswith(f"{BOXES}:") and s.message
    lines = report.lines()
    assert any(line.startswith("  skipped ") and "unfinished: no end-of-turn within" in line for line in lines)
    summaries, problems = validate("recipe", [str(output / "recipe.json")])
    assert not problems and summaries
    recipe = json.loads((output / "recipe.json").read_text())
    assert list(recipe) == ["boxes"] and recipe["boxes"]["annotation"] == "boxes.jsonl"
    assert recipe["boxes"]["root"] == str(BOXES.parent)
    # Nothing but the output folder was left next to it (the staging folder was renamed).
    assert sorted(p.name for p in output.parent.iterdir()) == [output.name]


@pytest.mark.heavy
def test_refusals_leave_nothing_behind(regenerator, regenerated, tmp_path):
    output, _ = regenerated
    with pytest.raises(SystemExit, match="already exists"):
        regen_module.regenerate(regenerator, BOXES, output)
    with pytest.raises(answers.NotGenerated, match="python -m valen_jax.predict"):
        regen_module.regenerate(regenerator, ROOT / "data/smoke/valen/train.jsonl", tmp_path / "valen")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.heavy
def test_a_drafter_on_the_regenerated_boxes_is_refused_with_the_counts_found(regenerated, target, tmp_path):
    """Boxes announce no atomic_decoding block (seed 004), so the regenerated recipe gives a drafter nothing
    to learn: it once "trained" at loss 0.0000; it is refused at start-up and leaves no workdir (issue 27)."""
    output, report = regenerated
    result = run_train("configs/vflash.py:tiny,drafter", tmp_path / "drafter", f"--config.model.target_from={target}",
                       f"--config.data.train={output / 'recipe.json'}", "--config.train.steps=2", check=False)
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert last.startswith("NothingToTrain: ") and f"{report.written} records, 0 primitive blocks" in last, last
    assert not (tmp_path / "drafter").exists()

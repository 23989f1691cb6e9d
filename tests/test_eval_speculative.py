"""`python -m valen_jax.evaluate` on a vflash (drafter) workdir (issue 16): the target's own report, the
speculative report beside it, identity with target-only greedy, and the drafter's target checked."""

from __future__ import annotations

import json
import shutil

import jax
import pytest

from tests.smoke_workdirs import smoke_workdir
from tests.test_evaluate_units import FakeHosts
from tests.train_runs import ROOT, run_train
from valen_jax import evaluate
from valen_jax.decoding.speculative import BlockStats
from valen_jax.evaluation import hosts as eval_hosts
from valen_jax.run import check_target, restore_drafter, restore_model
from valen_jax.training import checkpoint
from valen_jax.vflash.metrics import BlockSums

SMOKE = ROOT / "data/smoke/vflash"
MAX_NEW = 12  # under the smallest announced block (14): every from-call block runs to the budget
# Two recipe entries whose answers announce blocks, one (points) whose answers do not.
ENTRIES = {"drive": ("drive.jsonl", 2), "robot2d": ("robot2d.jsonl", 1), "points": ("points.jsonl", 1)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(target workdir, drafter workdir trained 4 steps against it, a 3-entry recipe of 4 records)."""
    home = tmp_path_factory.mktemp("speculative-eval")
    target = home / "target"  # a copy: one test takes a checkpoint step away from it
    shutil.copytree(smoke_workdir(tmp_path_factory, "configs/vflash.py:tiny"), target)
    drafter = home / "drafter"
    run_train("configs/vflash.py:tiny,drafter", drafter, f"--config.model.target_from={target}",
              "--config.train.steps=4", "--config.train.checkpoint_every=4", "--config.train.learning_rate=0.01")
    recipe = {}
    for name, (annotation, count) in ENTRIES.items():
        lines = (SMOKE / annotation).read_text().splitlines()[:count]
        (home / annotation).write_text("\n".join(lines) + "\n")
        recipe[name] = {"annotation": str(home / annotation), "root": str(SMOKE)}
    (home / "recipe.json").write_text(json.dumps(recipe))
    return target, drafter, home / "recipe.json"


@pytest.fixture(scope="module")
def reports(runs, tmp_path_factory):
    """(the target workdir's report, the drafter workdir's report through the CLI with --from_call)."""
    target, drafter, recipe = runs
    own = evaluate.evaluate_workdir(target, recipe, fmt="recipe", max_new_tokens=MAX_NEW)
    output = tmp_path_factory.mktemp("speculative-report") / "report.json"
    assert evaluate.main([f"--workdir={drafter}", f"--data={recipe}", "--format=recipe", f"--output={output}",
                          f"--max_new_tokens={MAX_NEW}", "--from_call"]) == 0
    return own, json.loads(output.read_text())


@pytest.mark.heavy
def test_the_ar_part_is_the_target_workdirs_own_report(reports):
    own, report = reports
    assert report["ar"] == {key: own[key] for key in report["ar"]}
    # The speculative evaluation does not swap images nor read the target's training data (issue 25 measured
    # image reliance and the text-only baseline in `evaluate.run`'s reports only), so its `ar` part has no
    # `image_reliance` and no `text_only_baseline`.
    assert set(report["ar"]) == set(own) - {"data", "format", "task", "step", "examples", "examples_in_data",
                                            "image_reliance", "text_only_baseline"}
    assert report["examples"] == own["examples"] == 4 and report["format"] == "vflash"
    # The speculative answers are scored by the same code: equal outputs give equal metrics.
    assert report["speculative"]["identical"] == 1.0
    assert report["speculative"]["metrics"] == own["metrics"]
    assert report["speculative"]["generation"] == own["generation"]
    assert [s["answer"] for s in report["speculative"]["samples"]] == [s["answer"] for s in own["samples"]]


@pytest.mark.heavy
def test_report_names_drafter_target_and_conventions(reports, runs):
    target, drafter, _ = runs
    _, report = reports
    assert report["drafter"]["workdir"] == str(drafter.resolve()) and report["drafter"]["step"] == 4
    assert report["drafter"]["block_size"] == 8  # configs/vflash.py:tiny,drafter
    assert report["drafter"]["target"]["workdir"] == str(target.resolve())
    assert "bonus token included" in report["speculative"]["tau_convention"]
    blocks = report["speculative"]["blocks"]
    assert set(blocks) == {"overall", "by_entry"}
    assert set(blocks["by_entry"]) == {"drive", "robot2d", "points"}
    for group in (blocks["overall"], *blocks["by_entry"].values()):
        assert set(group) == {"answers", "identical", "passes", "committed", "tau", "acceptance", "histogram",
                              "spelling", "stopped", "target_only_block_tokens", "answer_tokens", "ms_per_token",
                              "speedup"}
        assert list(group["acceptance"]) == [str(k) for k in range(1, 9)] and len(group["histogram"]) == 9
    assert [blocks["by_entry"][e]["answers"] for e in ("drive", "robot2d", "points")] == [2, 1, 1]


@pytest.mark.heavy
def test_from_call_blocks_are_drafted_and_their_sums_agree(reports):
    _, report = reports
    from_call = report["speculative"]["from_call"]
    assert from_call["answers_without_call"] == 1  # the points record announces nothing
    assert from_call["identical"] == 1.0
    overall, entries = from_call["blocks"]["overall"], from_call["blocks"]["by_entry"]
    assert set(entries) == {"drive", "robot2d"} and overall["answers"] == 3
    assert overall["passes"] > 0
    assert sum(overall["histogram"]) == overall["passes"]
    assert overall["tau"] == pytest.approx(overall["committed"] / overall["passes"])
    assert 1.0 <= overall["tau"] <= 9.0  # between the bonus alone and B + 1
    # Each block runs to the budget or a stop: both decoders commit the same block tokens.
    assert 0 < overall["committed"] == overall["target_only_block_tokens"] <= 3 * MAX_NEW
    for name in ("passes", "committed"):
        assert overall[name] == sum(e[name] for e in entries.values())
    first = overall["acceptance"]["1"]
    assert first is not None and 0.0 <= first <= 1.0
    histogram = overall["histogram"]
    accepted_first = sum(histogram[1:]) / overall["passes"]  # passes that accepted position 1
    assert first == pytest.approx(accepted_first)
    speed = overall["ms_per_token"]
    assert speed["speculative"] > 0
    # Whole answers, prompt to end, both decoders timed on the same answers.
    assert overall["answer_tokens"] > 0 and speed["target_only"] > 0
    assert overall["speedup"] == pytest.approx(speed["target_only"] / speed["speculative"])


@pytest.mark.heavy
def test_a_target_with_other_weights_is_refused_naming_both(runs):
    target, drafter, _ = runs
    run = restore_drafter(drafter)
    other = restore_model(target)
    assert other.identity == run.record["params_identity"]
    # The target retrained to other weights: its checkpoint's digests, hence its identity, differ.
    other.params = jax.tree.map(lambda x: x + 1 if x.ndim == 1 else x, other.params)
    other.identity = checkpoint.params_identity_of(other.params)
    with pytest.raises(checkpoint.CheckpointError, match="the target changed since") as caught:
        check_target(run.workdir, run.step, run.record, other)
    assert run.record["params_identity"] in str(caught.value) and str(run.workdir) in str(caught.value)
    assert other.identity in str(caught.value)


@pytest.mark.heavy
def test_a_drafter_whose_target_step_is_gone_is_refused(runs):
    target, drafter, recipe = runs
    shutil.rmtree(target / "checkpoints" / "4")  # the target retrained elsewhere or pruned: not those weights
    with pytest.raises(checkpoint.CheckpointError, match="cannot be restored") as caught:
        evaluate.evaluate_workdir(drafter, recipe, fmt="recipe", max_new_tokens=MAX_NEW)
    assert str(drafter.resolve()) in str(caught.value) and str(target.resolve()) in str(caught.value)


@pytest.mark.heavy
def test_predict_and_generate_name_the_target_of_a_drafter_workdir(runs):
    target, drafter, _ = runs
    with pytest.raises(checkpoint.CheckpointError, match="holds a vflash block drafter") as caught:
        restore_model(drafter)
    assert str(target.resolve()) in str(caught.value)


def _answer(passes: list[tuple[int, int, int]], entry: str, seconds: float = 0.01) -> BlockSums:
    blocks = BlockStats()
    for drafted, accepted, committed in passes:
        blocks.record(drafted, accepted, committed)
    stats = BlockSums(4)
    stats.add(blocks, identical=True, target_only_block_tokens=blocks.committed, answer_tokens=blocks.committed,
              target_only_seconds=2 * seconds, speculative_seconds=seconds, entry=entry)
    return stats


def test_block_sums_of_two_processes_are_the_merged_sums():
    parts = [_answer([(4, 4, 5), (2, 1, 2)], "drive"), _answer([(4, 0, 1)], "robot2d")]
    hosts = FakeHosts(2)
    summed = hosts.run(lambda i: eval_hosts.sum_stats(parts[i], hosts.gather).report())
    merged = _answer([(4, 4, 5), (2, 1, 2)], "drive").merge(_answer([(4, 0, 1)], "robot2d")).report()
    assert summed[0] == summed[1] == merged
    overall = merged["overall"]
    assert overall["passes"] == 3 and overall["committed"] == 8 and overall["tau"] == pytest.approx(8 / 3)
    assert overall["histogram"] == [1, 1, 0, 0, 1]  # accepted 0, 1 and 4 draft tokens
    # Position 1 drafted 3 times, accepted twice; positions 3, 4 drafted twice (the 2-token pass stops at 2).
    assert overall["acceptance"] == {"1": 2 / 3, "2": 1 / 3, "3": 0.5, "4": 0.5}
    assert overall["ms_per_token"]["target_only"] == pytest.approx(2 * overall["ms_per_token"]["speculative"])
    assert overall["speedup"] == pytest.approx(2.0)
    assert merged["by_entry"]["robot2d"]["tau"] == 1.0 and merged["by_entry"]["robot2d"]["acceptance"]["1"] == 0
    assert BlockSums(4).report()["overall"]["tau"] is None  # no pass: null, not 0


def test_ms_per_token_is_over_whole_answers_and_null_without_one():
    blocks = BlockStats()
    blocks.record(4, 4, 5)
    timed = BlockSums(4)
    timed.add(blocks, identical=True, target_only_block_tokens=5, answer_tokens=10,
              target_only_seconds=0.010, speculative_seconds=0.004)
    overall = timed.report()["overall"]
    assert overall["ms_per_token"] == {"target_only": pytest.approx(1.0), "speculative": pytest.approx(0.4)}
    assert overall["speedup"] == pytest.approx(2.5) and overall["answer_tokens"] == 10
    empty = BlockSums(4).report()["overall"]
    assert empty["ms_per_token"] == {"target_only": None, "speculative": None} and empty["speedup"] is None


def test_block_sums_refuse_draft_positions_past_the_block():
    with pytest.raises(ValueError, match=r"draft positions \[5\] outside 1..4"):
        _answer([(5, 0, 1)], "drive")
    with pytest.raises(ValueError, match="cannot merge"):
        BlockSums(4).merge(BlockSums(8))


def test_block_stats_add_sums_every_count_spelling_included():
    first, second = BlockStats(), BlockStats()
    first.record(3, 2, 3)
    second.record(2, 1, 2)
    second.add_counts(1, 5, [1, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0, 1], spelling_passes=2, spelling_committed=17,
                      stopped=1, undrafted=4)
    first.add(second)
    assert (first.passes, first.committed, first.stopped, first.undrafted) == (3, 10, 1, 4)
    assert first.tau == (10 + 4) / (3 + 4)  # a plain step after drafting stopped: a pass of one token
    assert first.drafted_at == {1: 3, 2: 3, 3: 2, 4: 1} and first.accepted_at == {1: 3, 2: 2, 3: 1, 4: 1}
    assert first.histogram == {2: 1, 1: 1, 4: 1}
    assert (first.spelling_passes, first.spelling_committed) == (2, 17)


def test_block_sums_carry_the_spelled_passes_apart_from_the_blocks():
    """`evaluate --drafter` reports the passes that verified a call's fixed text, summed over processes,
    without folding them into tau or the histogram."""
    parts = []
    for spelled in ((2, 17), (1, 9)):
        blocks = BlockStats()
        blocks.record(4, 4, 5)
        blocks.spelling_passes, blocks.spelling_committed = spelled
        stats = BlockSums(4)
        stats.add(blocks, identical=True, target_only_block_tokens=5, answer_tokens=40,
                  target_only_seconds=0.02, speculative_seconds=0.01, entry="drive")
        parts.append(stats)
    hosts = FakeHosts(2)
    summed = hosts.run(lambda i: eval_hosts.sum_stats(parts[i], hosts.gather).report())
    assert summed[0] == summed[1]
    overall = summed[0]["overall"]
    assert overall["spelling"] == {"passes": 3, "tokens": 26}
    assert overall["passes"] == 2 and overall["tau"] == pytest.approx(5.0) and sum(overall["histogram"]) == 2
    assert summed[0]["by_entry"]["drive"]["spelling"] == {"passes": 3, "tokens": 26}
    assert BlockSums(4).report()["overall"]["spelling"] == {"passes": 0, "tokens": 0}


def test_block_sums_count_the_plain_steps_of_a_stopped_span_in_tau():
    """A span whose drafting stopped (`loop.PATIENCE` misses in a row) is reported, summed over processes,
    and its plain steps are passes of one token in tau: giving up on a drafter never raises tau."""
    parts = []
    for stopped, undrafted in ((1, 6), (0, 0)):
        blocks = BlockStats()
        blocks.record(4, 0, 1)
        blocks.record(4, 0, 1)
        blocks.stopped, blocks.undrafted = stopped, undrafted
        stats = BlockSums(4)
        stats.add(blocks, identical=True, target_only_block_tokens=8, answer_tokens=40,
                  target_only_seconds=0.02, speculative_seconds=0.01, entry="drive")
        parts.append(stats)
    hosts = FakeHosts(2)
    overall = hosts.run(lambda i: eval_hosts.sum_stats(parts[i], hosts.gather).report())[0]["overall"]
    assert overall["stopped"] == {"spans": 1, "undrafted_tokens": 6}
    assert (overall["passes"], overall["committed"]) == (4, 4) and overall["histogram"] == [4, 0, 0, 0, 0]
    assert overall["tau"] == pytest.approx(1.0)

"""Hand-computed cases for the Valen, VFlash and chat evaluation metrics, and their all-reduce sums."""

from __future__ import annotations

import math

import numpy as np
import pytest

from valen_jax.evaluation.metrics import OVERALL
from valen_jax.evaluation.metrics.chat import ChatStats, ToolCallError, normalise_call
from valen_jax.evaluation.metrics.valen import ValenStats
from valen_jax.evaluation.metrics.vflash import VFlashStats, box_iou, greedy_match, split_masks

H1 = np.array([1.0, 0.0, 0.0])
META = {"domain": "traffic", "modality": "text", "language_bucket": "en"}


def _reduce(parts):
    """What a multi-host all-reduce does: union keys, sum vectors, rebuild."""
    keys = sorted(set().union(*(p.group_keys() for p in parts)))
    total = sum(p.to_vector(keys) for p in parts)
    return type(parts[0]).from_vector(total, keys, **parts[0]._config())


# -- Valen ---------------------------------------------------------------------------------------


def test_brier_and_cross_entropy_of_one_hot():
    s = ValenStats()
    s.add("choice", np.array([0.7, 0.2, 0.1]), H1, True, META)
    m = s.report()["overall"]
    assert m["brier"] == pytest.approx(0.09 + 0.04 + 0.01)
    assert m["cross_entropy"] == pytest.approx(-math.log(0.7))
    assert m["accuracy"] == 1.0 and m["rps"] is None


def test_cross_entropy_clips_zero_probability():
    s = ValenStats()
    s.add("noul", np.array([0.0, 1.0]), np.array([1.0, 0.0]), True)
    assert s.report()["overall"]["cross_entropy"] == pytest.approx(-math.log(1e-12))


def test_rps_of_score_question():
    s = ValenStats()
    # cumulative q = [.2, .7, 1], p = [0, 1, 1] → (.04 + .09 + 0) / (K − 1 = 2)
    s.add("score", np.array([0.2, 0.5, 0.3]), np.array([0.0, 1.0, 0.0]), True)
    s.add("score", np.array([0.5, 0.5]), np.array([0.5, 0.5]), False)  # soft: RPS 0
    r = s.report()
    assert r["by_type"]["score"]["rps"] == pytest.approx((0.065 + 0.0) / 2)
    assert r["by_type"]["score"]["accuracy"] == 1.0  # the soft one is not in accuracy


def test_ece_with_two_populated_bins():
    s = ValenStats()
    for probs, truth in [([0.95, 0.05], 0), ([0.95, 0.05], 1), ([0.65, 0.35], 0), ([0.35, 0.65], 1)]:
        s.add("noul", np.array(probs), np.eye(2)[truth], True)
    # bin 9: n=2, acc .5, conf .95; bin 6: n=2, acc 1, conf .65 → 2/4·.45 + 2/4·.35
    m = s.report()["overall"]
    assert m["ece"] == pytest.approx(0.4)
    assert m["accuracy"] == 0.75
    assert m["noul_confusion"] == {"true": {"true": 2, "false": 0}, "false": {"true": 1, "false": 1}}


def test_soft_labels_count_for_distributions_only():
    s = ValenStats()
    s.add("noul", np.array([0.6, 0.4]), np.array([1.0, 0.0]), True)
    s.add("noul", np.array([0.2, 0.8]), np.array([0.7, 0.3]), False)
    s.add("choice", np.array([0.5, 0.5]), None, False)
    m = s.report()["overall"]
    assert (m["questions"], m["labeled"], m["unlabeled"], m["hard_labeled"], m["soft_labeled"]) == (3, 2, 1, 1, 1)
    assert m["accuracy"] == 1.0  # only the hard one
    ce = (-math.log(0.6) - 0.7 * math.log(0.2) - 0.3 * math.log(0.8)) / 2
    assert m["cross_entropy"] == pytest.approx(ce)
    assert m["brier"] == pytest.approx((2 * 0.4**2 + 2 * 0.5**2) / 2)
    assert m["ece"] == pytest.approx(0.4)  # 1 hard question: |1 − .6|
    assert sum(sum(row.values()) for row in m["noul_confusion"].values()) == 1


def test_breakdowns_and_missing_values():
    s = ValenStats()
    s.add("choice", np.array([0.7, 0.3]), np.array([1.0, 0.0]), True, META)
    s.add("choice", np.array([0.7, 0.3]), np.array([0.0, 1.0]), True, {"domain": "kitchen"})
    r = s.report()
    assert r["by_domain"]["traffic"]["accuracy"] == 1.0 and r["by_domain"]["kitchen"]["accuracy"] == 0.0
    assert r["by_modality"]["(missing)"]["questions"] == 1
    assert set(r["by_type"]) == {"choice"}
    assert r["by_language_bucket"]["en"]["brier"] == pytest.approx(0.18)


@pytest.mark.parametrize("args", [
    ("multiple", [0.5, 0.5], [1.0, 0.0], True),
    ("choice", [0.5, 0.6], [1.0, 0.0], True),  # probs do not sum to 1
    ("choice", [0.5, 0.5], [0.5, 0.5], True),  # not one-hot
    ("choice", [0.5, 0.5], [1.0, 0.0, 0.0], True),  # size mismatch
    ("noul", [0.2, 0.3, 0.5], [1.0, 0.0, 0.0], True),
])
def test_bad_questions_refused(args):
    t, q, p, hard = args
    with pytest.raises(ValueError):
        ValenStats().add(t, np.array(q), np.array(p), hard)


def test_a_choice_with_one_candidate_evaluates():
    # Seed 000 allows 1–255 choice candidates; the one branch takes all the probability.
    stats = ValenStats()
    stats.add("choice", np.array([1.0]), np.array([1.0]), True, {"domain": "solo"})
    stats.add("choice", np.array([1.0]), None, False, {"domain": "solo"})
    stats.add("noul", np.array([0.25, 0.75]), np.array([1.0, 0.0]), True, {"domain": "pair"})
    r = stats.report()
    solo = r["by_domain"]["solo"]
    assert (solo["questions"], solo["labeled"], solo["hard_labeled"]) == (2, 1, 1)
    assert (solo["accuracy"], solo["cross_entropy"], solo["brier"], solo["ece"]) == (1.0, 0.0, 0.0, 0.0)
    assert solo["rps"] is None  # score questions only
    assert r["overall"]["accuracy"] == 0.5 and r["overall"]["ece"] == pytest.approx((0.0 + 0.75) / 2)
    with pytest.raises(ValueError, match="at least 1"):
        stats.add("choice", np.array([]), None, False)
    with pytest.raises(ValueError, match="2–10 grades"):
        stats.add("score", np.array([1.0]), np.array([1.0]), True)


def test_unknown_breakdown_key_refused():
    # record_id is in meta but is no breakdown: one group per record would swamp the report
    with pytest.raises(ValueError):
        ValenStats().add("choice", np.array([0.5, 0.5]), None, False, {"record_id": "x"})


def _random_questions(rng, n):
    out = []
    for i in range(n):
        t = ["choice", "noul", "score"][i % 3]
        k = 2 if t == "noul" else int(rng.integers(2, 6))
        q = rng.dirichlet(np.ones(k))
        kind = rng.integers(0, 3)
        label = None if kind == 0 else np.eye(k)[rng.integers(k)] if kind == 1 else rng.dirichlet(np.ones(k))
        meta = {"domain": f"d{i % 4}", "modality": "text", "language_bucket": ["en", "hi"][i % 2]}
        out.append((t, q, label, kind == 1, meta))
    return out


def test_report_matches_formulas_recomputed_from_answers():
    rng = np.random.default_rng(0)
    questions = _random_questions(rng, 60)
    s = ValenStats()
    for t, q, label, hard, meta in questions:
        s.add(t, q, label, hard, meta)
    labeled = [(t, q, p, h) for t, q, p, h, _ in questions if p is not None]
    hard = [(t, q, p) for t, q, p, h in labeled if h]
    ce = np.mean([-(p * np.log(np.maximum(q, 1e-12))).sum() for _, q, p, _ in labeled])
    brier = np.mean([((q - p) ** 2).sum() for _, q, p, _ in labeled])
    rps = np.mean([((np.cumsum(q) - np.cumsum(p)) ** 2).sum() / (len(q) - 1) for t, q, p, _ in labeled if t == "score"])
    acc = np.mean([q.argmax() == p.argmax() for _, q, p in hard])
    ece = 0.0
    for b in range(10):
        members = [(q.max(), q.argmax() == p.argmax()) for _, q, p in hard if min(int(10 * q.max()), 9) == b]
        if members:
            conf, ok = np.mean([c for c, _ in members]), np.mean([o for _, o in members])
            ece += len(members) / len(hard) * abs(ok - conf)
    m = s.report()["overall"]
    assert m["cross_entropy"] == pytest.approx(ce) and m["brier"] == pytest.approx(brier)
    assert m["rps"] == pytest.approx(rps) and m["accuracy"] == pytest.approx(acc)
    assert m["ece"] == pytest.approx(ece)


def test_merge_and_all_reduce_of_two_halves_equal_the_whole():
    questions = _random_questions(np.random.default_rng(1), 40)
    whole, a, b = ValenStats(), ValenStats(), ValenStats()
    for i, qn in enumerate(questions):
        whole.add(*qn)
        (a if i < 13 else b).add(*qn)
    reduced = _reduce([a, b])
    merged = ValenStats().merge(a).merge(b)
    for other in (reduced, merged):
        assert other.group_keys() == whole.group_keys()
        np.testing.assert_allclose(other.to_vector(whole.group_keys()), whole.to_vector())
    with pytest.raises(ValueError):
        a.to_vector(["overall"])  # leaving out a group would drop its sums


# -- VFlash --------------------------------------------------------------------------------------

CALL = '<tool_call>{{"name":"atomic_decoding","arguments":{{"block_size":{}}}}}</tool_call>'


def _traj(tag, values, dim):
    closer = "robot" if tag.startswith("robot") else tag
    body = "".join(f"<{v}>" for v in values)
    return CALL.format(len(values) + 2) + f"<{tag}>{body}</{closer}>"


def test_box_iou_and_greedy_matching():
    a, b = np.array([0.0, 0.0, 0.2, 0.2]), np.array([0.1, 0.1, 0.3, 0.3])
    assert box_iou(a, b) == pytest.approx(0.01 / 0.07)
    assert box_iou(a, np.array([0.5, 0.5, 0.6, 0.6])) == 0.0
    # greedy takes .9 first, leaving .2 for the other pair (Hungarian would pick .8 + .7 instead)
    assert greedy_match(np.array([[0.9, 0.8], [0.7, 0.2]])) == [(0, 0, 0.9), (1, 1, 0.2)]


def test_boxes_and_none():
    ref = "<ref>cup</ref><objects><box><0><0><200><200></box><box><500><500><600><600></box></objects>"
    pred = "<ref>cup</ref><objects><box><100><100><300><300></box></objects>"
    s = VFlashStats()
    s.add(ref, pred)
    s.add("<ref>dog</ref><objects>None</objects>", "<ref>dog</ref><objects>None</objects>")
    s.add("<ref>cat</ref><objects>None</objects>", "<ref>cat</ref><objects><box><1><1><2><2></box></objects>")
    box = s.report()["overall"]["box"]
    assert box["mean_iou"] == pytest.approx((1 / 7 + 0) / 2)
    assert box["acc_at_0.5"] == 0.0 and box["reference"] == 2 and box["predicted"] == 2
    assert box["none_reference"] == 2 and box["none_accuracy"] == 0.5


def test_points_distance_and_threshold():
    s = VFlashStats(point_threshold=0.05)
    s.add("<point><100><100></point><point><500><500></point>", "<point><130><140></point>")
    p = s.report()["overall"]["point"]
    assert p["distance"] == pytest.approx(0.05) and p["missing"] == 1
    assert p["accuracy"] == 0.5  # the hit within 0.05 and the missing one


def test_robot_3d_ade_fde_and_waypoint_mismatch():
    ref = _traj("robot_single", [500, 500, 500, 500, 500, 600], 3)  # (0,0,5), (0,0,6) m
    pred = _traj("robot_single", [530, 500, 500, 500, 540, 600, 0, 0, 0], 3)  # +0.3 x, +0.4 y, extra step
    s = VFlashStats()
    s.add(ref, pred, entry="robot3d_demo")
    r = s.report()
    t = r["overall"]["robot_3d"]
    assert t["ade"] == pytest.approx(0.35) and t["fde"] == pytest.approx(0.4)
    assert t["waypoint_mismatch"] == 1 and t["compared"] == 1
    assert r["by_entry"]["robot3d_demo"]["robot_3d"]["ade"] == pytest.approx(0.35)


def test_robot_2d_in_image_units_and_dual_arm():
    ref = CALL.format(8) + "<robot_left_2d><100><100></robot><robot_right_2d><500><500></robot>"
    pred = CALL.format(8) + "<robot_left_2d><100><200></robot><robot_right_2d><500><500></robot>"
    s = VFlashStats()
    s.add(ref, pred)
    t = s.report()["overall"]["robot_2d"]
    assert t["compared"] == 2 and t["ade"] == pytest.approx(0.05) and t["fde"] == pytest.approx(0.05)


def test_drive_ade_on_xy_and_heading():
    ref = _traj("drive", [0, 500, 500, 1000, 500, 500], 3)  # x = −10 and 250 m
    pred = _traj("drive", [0, 510, 750, 1000, 500, 0], 3)  # y +1.3 m, headings +π/2 and −π
    s = VFlashStats()
    s.add(ref, pred)
    d = s.report()["overall"]["drive"]
    assert d["ade"] == pytest.approx(0.65) and d["fde"] == pytest.approx(0.0)
    assert d["heading_error"] == pytest.approx((math.pi / 2 + math.pi) / 2)


def test_dense_error_honours_masks():
    ref = _traj("dense", [500, 500, 500, 500, 500, 500], 3)
    pred = _traj("dense", [750, 500, 500, 0, 0, 0], 3)  # frame 0 off by 1 m (s = 2), frame 1 way off
    s = VFlashStats()
    s.add(ref, pred, masks=["111011"])
    d = s.report()["overall"]["dense"]
    assert d["points"] == 1 and d["error"] == pytest.approx(1.0)
    s2 = VFlashStats()
    s2.add(ref, pred, dense_scale=4.0)
    d2 = s2.report()["overall"]["dense"]
    assert d2["points"] == 2 and d2["error"] == pytest.approx((2.0 + 4 * math.sqrt(3)) / 2)
    with pytest.raises(ValueError):
        VFlashStats().add(ref, pred, masks=["11"])


def test_malformed_prediction_and_well_formed_rate():
    ref = "<point><100><100></point>"
    s = VFlashStats()
    s.add(ref, "<point><100></point>")  # one number: does not parse
    s.add(ref, ref)
    m = s.report()["overall"]
    assert m["well_formed_rate"] == 0.5 and m["malformed"] == 1
    assert m["point"]["accuracy"] == 0.5 and m["point"]["distance"] == 0.0
    with pytest.raises(ValueError):
        s.add("<point><100></point>", ref)  # a bad reference is an error


def test_split_masks_per_answer():
    answers = ["<point><1><2></point>", "<ref>a</ref><objects>None</objects>", "<point><3><4></point>"]
    assert split_masks(answers, ["11", "01"]) == [("11",), (), ("01",)]
    with pytest.raises(ValueError):
        split_masks(answers, ["11"])


def test_vflash_merge_halves():
    rows = [("<point><100><100></point>", "<point><120><100></point>", "a"),
            (_traj("robot_single", [500] * 6, 3), _traj("robot_single", [510] * 6, 3), "b"),
            ("<ref>x</ref><objects>None</objects>", "<ref>x</ref><objects>None</objects>", "a")]
    whole, a, b = VFlashStats(), VFlashStats(), VFlashStats()
    for i, (ref, pred, entry) in enumerate(rows):
        whole.add(ref, pred, entry)
        (a if i == 0 else b).add(ref, pred, entry)
    assert _reduce([a, b]).report() == whole.report()
    assert a.merge(b).report() == whole.report()
    with pytest.raises(ValueError):
        VFlashStats(0.1).merge(VFlashStats(0.05))


# -- chat ----------------------------------------------------------------------------------------


def test_tool_call_equality_rules():
    chat = {"id": "call_1", "type": "function",
            "function": {"name": "book", "arguments": '{"slot": "morning", "date": "2026-09-17", "n": 1}'}}
    vak = {"id": "other", "name": "book", "arguments": {"date": "2026-09-17", "n": 1.0, "slot": "morning"}}
    assert normalise_call(chat) == normalise_call(vak)  # key order, number form and id ignored
    assert normalise_call({"name": "f", "arguments": {"x": True}}) != normalise_call({"name": "f", "arguments": {"x": 1}})
    assert normalise_call({"name": "f", "arguments": [1, 2]}) != normalise_call({"name": "f", "arguments": [2, 1]})
    with pytest.raises(ToolCallError):
        normalise_call({"name": "f", "arguments": "{not json"})


def test_tool_call_exact_match_and_breakdown():
    ref = [{"name": "check", "arguments": {"id": "SC-1"}}, {"name": "book", "arguments": {"a": 1, "b": 2}}]
    good = [{"name": "check", "arguments": {"id": "SC-1"}}, {"name": "book", "arguments": {"b": 2, "a": 1}}]
    wrong = [{"name": "check", "arguments": {"id": "SC-2"}}, {"name": "book"}]  # second is malformed
    s = ChatStats()
    s.add_tool_calls(ref, good, {"locale": "hi-Latn-IN", "source": "real"})
    s.add_tool_calls(ref, wrong, {"locale": "en-US", "source": "synthetic"})
    s.add_tool_calls([], [], {"locale": "en-US", "source": "synthetic"})
    r = s.report()
    m = r["overall"]
    assert m["exact_match"] == pytest.approx(2 / 3)
    assert m["tool_calls"] == {"reference": 4, "predicted": 4, "matched": 2, "name_matched": 3, "malformed": 1,
                               "call_precision": 0.5, "call_recall": 0.5}
    assert r["by_locale"]["hi-Latn-IN"]["exact_match"] == 1.0 and r["by_source"]["synthetic"]["exact_match"] == 0.5


def test_token_loss_accuracy_and_merge():
    a, b, whole = ChatStats(), ChatStats(), ChatStats()
    for s in (a, whole):
        s.add_tokens(nll_sum=2.0, correct=3.0, weight=4.0, breakdown={"locale": "en-US"})
    for s in (b, whole):
        s.add_tokens(nll_sum=4.0, correct=1.0, weight=4.0, breakdown={"source": "public"})
    m = _reduce([a, b]).report()
    assert m == whole.report()
    o = m["overall"]
    assert o["token_loss"] == pytest.approx(6 / 8) and o["token_accuracy"] == pytest.approx(0.5)
    assert o["perplexity"] == pytest.approx(math.exp(0.75))
    assert m["by_source"]["(missing)"]["token_loss"] == pytest.approx(0.5)
    assert m["by_locale"]["(missing)"]["token_accuracy"] == pytest.approx(0.25)
    with pytest.raises(ValueError):
        a.add_tokens(1.0, 5.0, 4.0)  # more correct than counted


def test_empty_report_is_null_not_nan():
    assert ValenStats().report()["overall"]["accuracy"] is None
    assert VFlashStats().report()["overall"]["well_formed_rate"] is None
    assert ChatStats().report()["overall"]["token_loss"] is None
    assert OVERALL not in ValenStats().group_keys()

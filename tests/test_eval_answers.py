"""Seed 003's answer comparison ("the grader compares the model's answer with the assistant message")
and the vakforge entity accuracy in evaluation reports: the normalisation, the sums, the reference
texts the renderer records, and end-to-end reports on the smoke chat and vakforge data from tiny
trained workdirs, recomputed from the decoded messages the report lists."""

from __future__ import annotations

import jax
import pytest

from data_pipeline.formats.chat import read_chat
from data_pipeline.render.chat import ChatRenderer
from data_pipeline.tokenizer import load_tokenizer
from tests.smoke_workdirs import smoke_workdir
from tests.train_runs import ROOT
from valen_jax import evaluate
from valen_jax.evaluation import chat, registry
from valen_jax.evaluation import workdir as eval_workdir
from valen_jax.evaluation.metrics.answer_match import answer_matches, normalise_answer
from valen_jax.evaluation.metrics.chat import ChatStats
from valen_jax.evaluation.metrics.entities import Generated, entity_found
from valen_jax.training import checkpoint

CHAT_EVAL = ROOT / "data/smoke/chat/eval.jsonl"
VAKFORGE = ROOT / "data/smoke/vakforge/vakforge.jsonl"
NEW_TOKENS = 3


@pytest.mark.parametrize(("reference", "generated", "exact", "normalised"), [
    ("It is 2C and snowing in Oslo.", "It is 2C and snowing in Oslo.", True, True),
    ("It is 2C and snowing in Oslo.", "it is 2c and  snowing\nin oslo", False, True),  # case, spaces, final dot
    ("«Yes!»", "yes", False, True),  # surrounding punctuation of any script
    ('{"total": 2167}', '{"total": 2167}', True, True),
    ('{"total": 2167}', '{"total":2167}', False, False),  # inner spacing is kept: not JSON equality
    ("2,167", "2167", False, False),  # inner punctuation is kept
    ("１２９０", "1290", False, True),  # NFKC: full-width digits
    ("Straße", "STRASSE", False, True),  # case folding, not lower()
    ("27", "27 ", False, True),
    ("27", "72", False, False),
])
def test_answer_exact_and_normalised_match(reference, generated, exact, normalised):
    assert answer_matches(reference, generated) == (exact, normalised)


def test_normalisation_collapses_and_strips_only_the_edges():
    assert normalise_answer("  Hello,\t\tWORLD …  ") == "hello, world"
    assert normalise_answer("...") == ""


def test_answer_sums_by_locale_and_source():
    stats = ChatStats()
    en, hi = {"locale": "en-US", "source": "synthetic"}, {"locale": "hi-Latn-IN", "source": "real"}
    stats.add_answer("Done.", "Done.", True, en)  # exact
    stats.add_answer("Done.", "done", True, en)  # normalised only
    stats.add_answer("Ji, ho gaya.", "Ji", False, hi)  # neither, cut at max_new_tokens
    stats.add_tool_calls([{"name": "f", "arguments": "{}"}], [{"name": "f", "arguments": {}}], hi)
    report = stats.report()
    overall = report["overall"]["answers"]
    assert overall == {"messages": 3, "exact": 1, "normalised": 2, "unfinished": 1,
                       "exact_match": pytest.approx(1 / 3), "normalised_match": pytest.approx(2 / 3)}
    assert report["overall"]["messages"] == 1 and report["overall"]["exact_match"] == 1.0  # calls apart
    assert report["by_locale"]["en-US"]["answers"]["normalised_match"] == 1.0
    assert report["by_source"]["real"]["answers"]["exact_match"] == 0.0
    assert report["by_source"]["real"]["answers"]["unfinished"] == 1


def test_the_chat_renderer_records_each_assistant_message_text():
    renderer = ChatRenderer(load_tokenizer(ROOT / "data/tokenizer"))
    records = read_chat(CHAT_EVAL)
    # Row 2 is [call message, "It is 21C and cloudy in Nairobi."]; row 3 two text answers.
    metas = [renderer.render(r, "eval").meta for r in records[1:3]]
    assert metas[0]["answers"] == ["", "It is 21C and cloudy in Nairobi."]
    assert metas[0]["tool_calls"][0] and not metas[0]["tool_calls"][1]
    assert metas[1]["answers"] == ["27", "54"]


def _recount(samples: list[dict]) -> dict:
    """The answer sums, recomputed from the decoded messages the report lists."""
    texts = [s for s in samples if isinstance(s["reference"], str)]
    pairs = [answer_matches(s["reference"], s["answer"]) for s in texts]
    return {"messages": len(texts), "exact": sum(e for e, _ in pairs), "normalised": sum(n for _, n in pairs),
            "unfinished": sum(not s["finished"] for s in texts)}


@pytest.fixture(scope="module")
def chat_restored(tmp_path_factory):
    return eval_workdir.restore(smoke_workdir(tmp_path_factory, "configs/chat.py:tiny", "--config.train.steps=4"))


@pytest.mark.slow
def test_chat_report_compares_every_answer_with_its_reference(chat_restored):
    with jax.set_mesh(chat_restored.mesh):
        report = evaluate.run(chat_restored, CHAT_EVAL, "chat", {"assistant_turns": "all"},
                              max_new_tokens=NEW_TOKENS, samples=None)
    # The smoke eval set: 12 rows, 18 assistant messages, 3 of them tool calls, 15 with text.
    assert report["generation"]["tool_call_messages"] == 3 and report["generation"]["answer_messages"] == 15
    answers = report["metrics"]["overall"]["answers"]
    assert {k: answers[k] for k in ("messages", "exact", "normalised", "unfinished")} == _recount(report["samples"])
    assert 0.0 <= report["answer_exact_match"] <= report["answer_normalised_match"] <= 1.0
    assert report["answer_exact_match"] == answers["exact_match"]
    assert len(report["samples"]) == 18 and {s["message"] for s in report["samples"]} == {0, 1}
    assert list(report["metrics"]["by_locale"]) == ["(missing)"]
    assert report["metrics"]["by_locale"]["(missing)"]["answers"] == answers
    assert report["entity_accuracy"] is None and report["entities"]["overall"]["entities"] == 0
    assert report["skipped"] == {"examples_without_reference_answers": 0}
    assert "answer exact/normalised match" in evaluate.summary(report)


@pytest.mark.slow
def test_examples_without_reference_texts_are_counted_not_scored(chat_restored):
    # Shards written before meta `answers` existed: tool calls are still compared, answers are not.
    with jax.set_mesh(chat_restored.mesh):
        examples, _, _ = eval_workdir.load_examples(
            "chat", CHAT_EVAL, chat_restored.workdir, checkpoint.tokenizer_dir(chat_restored.workdir),
            chat_restored.fingerprint, {"assistant_turns": "all"}, 4)
        for example in examples:
            del example.meta["answers"]
        # The evaluation batch size of the run: the compiled functions of the test above serve again.
        options = registry.Options(batch_size=int(chat_restored.config.eval.batch_size), max_new_tokens=1)
        part = chat.evaluate(chat_restored, examples, options)
    assert part["skipped"] == {"examples_without_reference_answers": 4}
    assert part["generation"]["answer_messages"] == 0 and part["answer_exact_match"] is None
    assert part["generation"]["tool_call_messages"] == 1  # row 2 of the first four


@pytest.mark.slow
def test_vakforge_report_has_answer_match_and_entity_accuracy(tmp_path_factory):
    restored = eval_workdir.restore(smoke_workdir(tmp_path_factory, "configs/vakforge.py:tiny"))
    with jax.set_mesh(restored.mesh):
        # The train split: the two conversations whose agent turns carry entities (a date in en-US,
        # an amount in hi-Latn-IN); dev holds none.
        report = evaluate.run(restored, VAKFORGE, "vakforge", {"split": "train", "overlap": "merge"},
                              max_new_tokens=NEW_TOKENS, samples=None)
    assert report["format"] == "vakforge" and report["examples"] == 2
    entities = report["entities"]
    assert entities["overall"]["entities"] == 2
    assert set(entities["by_type"]) == {"date", "amount_inr"}
    assert set(entities["by_locale"]) == {"en-US", "hi-Latn-IN"} and set(entities["by_source"]) == {"synthetic", "real"}
    # Recomputed from the listed messages: each entity's verdict, and the accuracy from them.
    found = [e["found"] for s in report["samples"] for e in s.get("entities", [])]
    assert len(found) == 2 and entities["overall"]["correct"] == sum(found)
    assert report["entity_accuracy"] == sum(found) / 2
    for sample in report["samples"]:
        for listed in sample.get("entities", []):
            calls = chat.parse_tool_calls(sample["answer"])
            assert entity_found(listed, Generated.of(sample["answer"], calls)) is listed["found"]
    answers = report["metrics"]["overall"]["answers"]
    assert answers["messages"] > 0 and {k: answers[k] for k in ("messages", "exact", "normalised", "unfinished")} == _recount(
        report["samples"])
    assert report["generation"]["tool_call_messages"] == report["metrics"]["overall"]["messages"] == 3
    assert set(report["metrics"]["by_locale"]) == {"en-US", "hi-Latn-IN"}
    assert "entity accuracy" in evaluate.summary(report)

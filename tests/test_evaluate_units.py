"""Evaluation pieces without a model: summing across processes, answer spans, masks, tool-call parsing."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import ml_collections
import numpy as np
import pytest

from data_pipeline.shards import Example
from valen_jax.evaluation import hosts as eval_hosts
from valen_jax.evaluation.chat import parse_tool_calls
from valen_jax.evaluation.metrics.chat import ChatStats
from valen_jax.evaluation.metrics.valen import ValenStats
from valen_jax.evaluation.prompts import answer_spans
from valen_jax.evaluation.vflash import answer_masks
from valen_jax.evaluation.workdir import data_format


class FakeHosts:
    """`gather` for N threads acting as N processes: each call is one all-gather."""

    def __init__(self, count: int):
        self.count = count
        self.slots: list = [None] * count
        self.barrier = threading.Barrier(count)
        self.local = threading.local()

    def gather(self, x):
        index = self.local.index
        self.slots[index] = np.asarray(x)
        self.barrier.wait()
        out = np.stack(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before everyone has read it
        return out

    def run(self, work):
        results = [None] * self.count

        def target(i):
            self.local.index = i
            results[i] = work(i)

        threads = [threading.Thread(target=target, args=(i,)) for i in range(self.count)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results


def _valen_part(domain: str, correct: bool) -> ValenStats:
    stats = ValenStats()
    probs = np.array([0.8, 0.2]) if correct else np.array([0.3, 0.7])
    stats.add("noul", probs, np.array([1.0, 0.0]), True, {"domain": domain})
    stats.add("choice", np.array([0.5, 0.25, 0.25]), None, False, {"domain": domain})
    return stats


def test_two_processes_with_different_groups_sum_to_the_merged_stats():
    parts = [_valen_part("traffic", True), _valen_part("kitchen", False)]
    hosts = FakeHosts(2)
    assert parts[0].group_keys() != parts[1].group_keys()
    summed = hosts.run(lambda i: eval_hosts.sum_stats(parts[i], hosts.gather).report())
    merged = _valen_part("traffic", True).merge(_valen_part("kitchen", False)).report()
    assert summed[0] == summed[1] == merged
    assert set(merged["by_domain"]) == {"traffic", "kitchen"}
    assert merged["overall"]["questions"] == 4 and merged["overall"]["accuracy"] == 0.5


def test_a_process_that_saw_nothing_still_joins_the_sum():
    hosts = FakeHosts(3)
    parts = [ChatStats(), ChatStats(), ChatStats()]
    parts[1].add_tokens(2.0, 1.0, 4.0, {"locale": "en-GB", "source": "real"})
    summed = hosts.run(lambda i: eval_hosts.sum_stats(parts[i], hosts.gather).report())
    assert summed[0] == summed[2] == parts[1].report()
    assert summed[0]["overall"]["token_loss"] == 0.5


def test_one_process_is_the_identity():
    stats = _valen_part("traffic", True)
    assert eval_hosts.sum_stats(stats).report() == stats.report()
    assert eval_hosts.gather_json({"a": [1, "é"]}) == [{"a": [1, "é"]}]
    np.testing.assert_array_equal(eval_hosts.sum_array(np.array([1.0, 2.0])), [1.0, 2.0])


def test_gather_json_of_different_lengths():
    hosts = FakeHosts(2)
    values = [[], [{"index": 3, "text": "a longer value"}]]
    out = hosts.run(lambda i: eval_hosts.gather_json(values[i], hosts.gather))
    assert out[0] == out[1] == values


def test_processes_take_disjoint_slices_and_the_same_number_of_batches():
    slices = [eval_hosts.local_indices(7, i, 3) for i in range(3)]
    assert slices == [[0, 3, 6], [1, 4], [2, 5]]
    assert eval_hosts.batch_count(7, 2, 3) == 2  # the process with 3 examples needs 2 batches of 2
    assert eval_hosts.batch_count(0, 2, 1) == 0


def test_answer_spans_split_only_at_end_of_turn():
    eot = 9
    ids = np.array([1, 2, 5, 6, 9, 3, 4, 7, 8, 7, 9])
    weights = np.array([0, 0, 1, 1, 1, 0, 0, 1, 0, 1, 1], np.float32)  # position 8: a masked coordinate
    assert answer_spans(ids, weights, eot) == [(2, 5), (7, 11)]


def test_answer_masks_rebuilt_from_weights_and_spans():
    eot, numbers = 9, np.array([100, 101, 102])
    # ... <point> 100 101 </point> <eot> (first answer) ... <box> 100 101 102 100 </box> <eot>
    ids = np.array([1, 50, 100, 101, 51, 9, 2, 52, 100, 101, 102, 100, 53, 9])
    weights = np.array([0, 1, 1, 1, 1, 1, 0, 1, 1, 0, 1, 1, 1, 1], np.float32)
    spans = np.array([[0, 1, 5], [1, 7, 13]], np.int32)
    example = Example(arrays={"input_ids": ids, "target_weights": weights, "primitive_spans": spans}, meta={})
    assert answer_masks(example, eot, numbers) == ["1011"]


def test_tool_calls_parsed_from_chatml_and_llama3():
    text = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>\n{"name": broken}\n</tool_call>\n<tool_call>\n{"name": "x"')
    calls = parse_tool_calls(text)
    assert calls[0] == {"name": "get_weather", "arguments": {"city": "Oslo"}}
    assert isinstance(calls[1], str) and isinstance(calls[2], str)  # unreadable and unclosed: malformed
    assert parse_tool_calls("It is sunny.") == []
    stats = ChatStats()
    stats.add_tool_calls([{"name": "get_weather", "arguments": '{"city": "Oslo"}'}], calls)
    row = stats.report()["overall"]
    assert row["exact_match"] == 0.0 and row["tool_calls"]["matched"] == 1 and row["tool_calls"]["malformed"] == 2
    assert parse_tool_calls('{"name": "f", "parameters": {"a": 1}}', "llama3") == [{"name": "f", "arguments": {"a": 1}}]


def test_the_format_comes_from_the_checkpoint_config_not_the_path():
    config = ml_collections.ConfigDict({"data": {"eval_format": "vakforge", "eval_options": {"split": "dev"}}})
    restored = SimpleNamespace(config=config)
    assert data_format(restored, None) == ("vakforge", {"split": "dev"})
    assert data_format(restored, "chat") == ("chat", {})
    with pytest.raises(ValueError, match="--format"):
        data_format(restored, "parquet")


@pytest.mark.parametrize(("saved", "devices", "fitted"), [
    ({"data": -1, "fsdp": 4, "tensor": 2}, 8, {"data": 1, "fsdp": 4, "tensor": 2}),  # as trained
    ({"data": -1, "fsdp": 4, "tensor": 1}, 16, {"data": 4, "fsdp": 4, "tensor": 1}),  # more devices: more data
    ({"data": 2, "fsdp": 4, "tensor": 1}, 16, {"data": 4, "fsdp": 4, "tensor": 1}),
    ({"data": 2, "fsdp": 4, "tensor": 2}, 4, {"data": 1, "fsdp": 2, "tensor": 2}),  # fewer: fsdp shrinks
    ({"data": 2, "fsdp": 4, "tensor": 1}, 1, {"data": 1, "fsdp": 1, "tensor": 1}),
    ({"data": 1, "fsdp": -1, "tensor": 2}, 8, {"data": 1, "fsdp": 4, "tensor": 2}),  # -1: the rest, as in training
])
def test_the_evaluation_mesh_keeps_the_training_model_axes(saved, devices, fitted):
    from valen_jax.run import fitted_mesh_shape
    assert fitted_mesh_shape(saved, devices) == fitted


def test_evaluators_are_found_by_example_kind():
    from valen_jax.evaluation import chat, registry, valen, vflash

    assert registry.evaluator_for("valen").evaluate is valen.evaluate
    assert registry.evaluator_for("vakforge") == registry.evaluator_for("chat") == registry.Evaluator(
        chat.evaluate, chat.summary)
    assert registry.evaluator_for("vflash").summary is vflash.summary
    with pytest.raises(ValueError, match=r"eval\.jsonl: no evaluation defined for 'prepared' data"):
        registry.evaluator_for("prepared", "eval.jsonl")
    # Found through the format registry's family: recipe shards are evaluated as VFlash.
    from data_pipeline.format_registry import FORMATS
    assert {name for name, f in FORMATS.items() if f.family in registry.EVALUATORS} == set(FORMATS) - {"prepared"}
    assert registry.evaluator_for(FORMATS["recipe"].family) is registry.EVALUATORS["vflash"]
    line = registry.evaluator_for("chat").summary({"loss": 1.5, "accuracy": None, "tool_call_exact_match": 0.25})
    assert line == "loss 1.5000, accuracy n/a, tool-call exact match 0.2500"


def test_vakforge_breaks_down_by_locale_and_meta_source():
    from valen_jax.evaluation.chat import breakdown_of

    vakforge = Example(arrays={}, meta={"format": "vakforge", "locale": "en-GB", "data_source": "synthetic"})
    assert breakdown_of(vakforge) == {"locale": "en-GB", "source": "synthetic"}
    stats = ChatStats()
    stats.add_tokens(1.0, 1.0, 2.0, breakdown_of(vakforge))
    stats.add_tokens(3.0, 0.0, 2.0, breakdown_of(Example(arrays={}, meta={"format": "chat"})))
    report = stats.report()
    assert report["by_locale"]["en-GB"]["token_loss"] == 0.5 and report["by_source"]["(missing)"]["tokens"] == 2.0

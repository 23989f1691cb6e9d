"""Issue 54's evidence: lm-eval's `local-completions` model running a loglikelihood (multiple-choice) task
against `serve` gets, per choice, the log-likelihood our model computes offline for the same prompt and
continuation (within 1e-4), and the same accuracy.

lm-eval (with the workdir's tokenizer, `tokenizer_backend=huggingface`) sends each (context,
continuation) pair as token ids with `echo: true, max_tokens: 1, logprobs: 1` and sums the echoed
continuation tokens' `token_logprobs`. Offline, the restored workdir (`run.restore_model`, as `evaluate`
restores it) runs one teacher-forced forward over the same ids, float32 log-softmax over the tokenizer's
vocabulary, in numpy here. The ids are lm-eval's own encoding (`_encode_pair`: trailing spaces of the
context move to the continuation), and the test also checks they are what the server received. The
tiny model's accuracy is near chance, so each choice's log-likelihood is compared, not only the score."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from flax import nnx

from tests.serve_server import Served
from tests.smoke_workdirs import smoke_workdir

TASK = "valen_smoke_weather_choice"
DOCS = [
    {"question": "What is the weather in Wellington?", "choices": ["windy", "sunny", "snowing"], "answer": 0},
    {"question": "What is 4 plus 23?", "choices": ["27", "31", "19"], "answer": 0},
    {"question": "Which city is the capital of Norway?", "choices": ["Bergen", "Oslo", "Paris"], "answer": 1},
    {"question": "What colour is the sky on a clear day?", "choices": ["green", "red", "blue"], "answer": 2},
]


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's `TemplateLM._encode_pair` for a causal model (its huggingface backend: no special tokens)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    context_ids = tokenizer(context, add_special_tokens=False).input_ids
    return context_ids, whole[len(context_ids):]


@pytest.mark.slow
def test_lm_eval_loglikelihood_equals_offline(tmp_path_factory, tmp_path):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.tasks import TaskManager

    from valen_jax.run import restore_model

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps(d) + "\n" for d in DOCS), encoding="utf-8")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / f"{TASK}.yaml").write_text(json.dumps({  # YAML is a superset of JSON
        "task": TASK, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(docs)}},
        "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "Question: {{question}}\nAnswer:",
        "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}", "target_delimiter": " ",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    }), encoding="utf-8")

    workdir = smoke_workdir(tmp_path_factory, "configs/chat.py:tiny", "--config.train.steps=4")
    served = Served(workdir, slots=2, max_queue=32)
    received = []  # the prompts lm-eval posted, as token ids
    prompts = served.service.completion_prompts
    served.service.completion_prompts = lambda body: received.extend(p["ids"].tolist() for p in prompts(body)) or prompts(body)
    try:
        results = simple_evaluate(
            model="local-completions",
            model_args={"model": served.service.name, "base_url": served.url + "/v1/completions",
                        "tokenizer_backend": "huggingface", "tokenizer": str(workdir / "tokenizer"),
                        "num_concurrent": 1, "max_retries": 1, "timeout": 120},
            tasks=[TASK], task_manager=TaskManager(include_path=str(tasks)), log_samples=True, num_fewshot=0,
            batch_size=1)
    finally:
        served.close()

    restored = restore_model(workdir)  # offline: the workdir as `evaluate` restores it
    tokenizer, vocab = restored.tokenizer, len(restored.tokenizer)
    model = nnx.merge(restored.graphdef, restored.params)

    def loglikelihood(context_ids: list[int], continuation_ids: list[int]) -> float:
        ids = np.asarray([context_ids + continuation_ids], np.int32)
        positions = np.arange(ids.shape[1], dtype=np.int32)[None]
        logits = np.asarray(model(ids, positions, np.ones_like(ids)), np.float32)[0, :-1, :vocab]
        logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
        targets = np.arange(len(context_ids) - 1, ids.shape[1] - 1)
        return float(logp[targets, ids[0, targets + 1]].sum())

    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    assert len(samples) == len(DOCS)
    correct, pairs, worst = [], set(), 0.0
    for sample, doc in zip(samples, DOCS, strict=True):
        context = f"Question: {doc['question']}\nAnswer:"
        theirs = [float(r[0][0]) for r in sample["resps"]]
        ours = []
        for choice in doc["choices"]:
            context_ids, continuation_ids = encode_pair(tokenizer, context, " " + choice)
            pairs.add(tuple(context_ids + continuation_ids))
            ours.append(loglikelihood(context_ids, continuation_ids))
        np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)
        worst = max(worst, float(np.max(np.abs(np.asarray(theirs) - np.asarray(ours)))))
        correct.append(int(np.argmax(ours)) == doc["answer"])
    assert pairs == {tuple(ids) for ids in received}  # the server scored exactly these sequences
    accuracy = results["results"][TASK]["acc,none"]
    assert accuracy == pytest.approx(float(np.mean(correct)))
    print(f"lm_eval_acc={accuracy} offline_acc={np.mean(correct)} max_abs_diff={worst:.2e} "
          f"choices={sum(len(d['choices']) for d in DOCS)} "
          f"lm_eval={lm_eval.__version__}")

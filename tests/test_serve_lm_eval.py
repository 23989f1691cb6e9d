"""Issue 31's evidence: lm-eval's OpenAI-compatible chat model (`local-chat-completions`) against the
served smoke chat workdir scores exactly what `python -m valen_jax.evaluate` scores on the same rows.

The rows are the smoke chat eval rows whose prompt lm-eval can send as-is: one system message (the
same for all of them, lm-eval's `system_instruction`), one user message, one assistant answer, no
tools, no images. Both sides decode greedily with the same token budget and compare whole messages
character for character (lm-eval's `exact_match`, `valen_jax.evaluation.metrics.answer_match`'s exact
rule); lm-eval is given no stop strings, so both stop only at the end-of-turn token or the budget.
The tiny model's scores are 0, so the score equality alone proves little: each answer lm-eval logged
(`log_samples=True`) is also compared with the answer `evaluate` decoded for that row, and each
conversation lm-eval posted with the row's messages before its answer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.serve_server import Served
from tests.smoke_workdirs import smoke_workdir
from valen_jax.evaluation.report import evaluate_workdir

ROWS = Path(__file__).resolve().parents[1] / "data/smoke/chat/eval.jsonl"
MAX_NEW = 16
TASK = "valen_smoke_chat_answers"


def answerable(row: dict) -> bool:
    roles = [m["role"] for m in row["messages"]]
    return (roles == ["system", "user", "assistant"] and "tools" not in row
            and all(isinstance(m["content"], str) for m in row["messages"]))


@pytest.mark.slow
def test_lm_eval_exact_match_equals_evaluate(tmp_path_factory, tmp_path):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.tasks import TaskManager

    rows = [r for r in map(json.loads, ROWS.read_text(encoding="utf-8").splitlines()) if answerable(r)]
    (system,) = {r["messages"][0]["content"] for r in rows}  # lm-eval sends one system message for the task
    assert len(rows) >= 3
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"user": r["messages"][1]["content"], "target": r["messages"][2]["content"]})
                            + "\n" for r in rows), encoding="utf-8")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / f"{TASK}.yaml").write_text(json.dumps({  # YAML is a superset of JSON
        "task": TASK, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(docs)}},
        "test_split": "test", "output_type": "generate_until", "doc_to_text": "{{user}}",
        "doc_to_target": "{{target}}", "target_delimiter": "", "fewshot_delimiter": "",
        "generation_kwargs": {"until": [], "max_gen_toks": MAX_NEW, "do_sample": False, "temperature": 0},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
    }), encoding="utf-8")

    workdir = smoke_workdir(tmp_path_factory, "configs/chat.py:tiny", "--config.train.steps=4")
    served = Served(workdir, slots=4, max_queue=32)
    sent = []  # the conversations lm-eval posted, as the server read them
    chat_prompt = served.service.chat_prompt
    served.service.chat_prompt = lambda body: sent.append(body.model_dump(exclude_none=True)["messages"]) or chat_prompt(body)
    try:
        model = served.service.name
        results = simple_evaluate(
            model="local-chat-completions",
            model_args={"model": model, "base_url": served.url + "/v1/chat/completions", "tokenizer_backend": None,
                        "num_concurrent": 1, "max_retries": 1, "timeout": 60},
            tasks=[TASK], task_manager=TaskManager(include_path=str(tasks)), apply_chat_template=True,
            system_instruction=system, log_samples=True, num_fewshot=0, batch_size=1)
    finally:
        served.close()
    report = evaluate_workdir(workdir, data, max_new_tokens=MAX_NEW, samples=None)

    # lm-eval sent each row's conversation before its answer, unchanged (so the prompts are the rows').
    assert sorted(map(json.dumps, sent)) == sorted(json.dumps(r["messages"][:2]) for r in rows)
    score = results["results"][TASK]["exact_match,none"]
    assert report["generation"]["answer_messages"] == len(rows)
    assert score == report["answer_exact_match"]
    logged = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    assert [s["target"] for s in logged] == [r["messages"][2]["content"] for r in rows]
    theirs = [s["resps"][0][0] for s in logged]
    ours = [s["answer"] for s in sorted(report["samples"], key=lambda s: s["index"])]
    assert theirs == ours, (theirs, ours)
    print(f"lm_eval_exact_match={score} evaluate_answer_exact_match={report['answer_exact_match']} "
          f"answers={ours} lm_eval={lm_eval.__version__}")

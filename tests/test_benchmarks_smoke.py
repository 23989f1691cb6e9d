"""`benchmarks/vision_learning.py --smoke` (issue 55): the task-family benchmark's every part (data, one training
run per task, every checkpoint's evaluation, figures.json) runs on the CPU at tiny sizes, and its last line is
the one the issue asks for."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.heavy  # two training subprocesses (start-up and compile ~40 s each) and four evaluations
def test_vision_learning_smoke_reports_every_task_and_ends_with_the_verdict(tmp_path):
    done = subprocess.run([sys.executable, "benchmarks/vision_learning.py", "--smoke", f"--workdir={tmp_path}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    found = re.fullmatch(r"vision_tasks_passed=(\d+)/2 worst_task=(small|box) worst_accuracy=(\d\.\d\d)", lines[-1])
    assert found, lines[-1]
    # A learning curve: each task's two checkpoints, with every figure the issue names.
    for task, metric in (("small", "point"), ("box", "box")):
        for step in (2, 4):
            assert any(re.fullmatch(rf"{task} step {step}: {metric} accuracy \d\.\d{{3}}, image reliance \S+ "
                                    r"\(changed \S+\), accuracy drop \S+, text-only baseline \S+, trained \S+ s, "
                                    r"loss \S+", line) for line in lines), (task, step, lines)
    figures = json.loads((tmp_path / "figures.json").read_text())
    assert list(figures["tasks"]) == ["small", "box"] and figures["total"] == 2
    for task, metric in (("small", "point"), ("box", "box")):
        part = figures["tasks"][task]
        assert part["metric"] == metric and part["train_records"] == 32
        rows = part["rows"]  # the longest record with its 16 vision tokens fits, with room to spare
        assert rows["vision_tokens"] == 16 and rows["seq_len"] % 16 == 0
        assert rows["longest_record_tokens"] - 1 + 16 < rows["seq_len"] <= rows["longest_record_tokens"] + 15 + 32
        assert [c["step"] for c in part["checkpoints"]] == [2, 4]
        last = part["checkpoints"][-1]
        assert 0 <= last["accuracy"] <= 1 and last["text_only_baseline"] is not None and last["train_seconds"] > 0
        assert last["accuracy_drop"] is not None and last["changed_fraction"] is not None
    worst = min(figures["tasks"].values(), key=lambda part: part["final_accuracy"])["final_accuracy"]
    assert float(found.group(3)) == round(worst, 2) and int(found.group(1)) == figures["passed"]

"""Issue 25: a model this stack trains looks at its image, and a blind one is reported as blind.

The tasks come from the committed generator `data/make_vision_tasks.py`: a 64 × 64 grey image with one
red disc of radius 6 on the left or the right, the same question for every record, the answer
`<point><250><500></point>` or `<point><750><500></point>` (one informative token, a coin flip from the
text). Before the fix `configs/vflash.py` answered every test record with the same point (accuracy 0.6,
the majority class): at the full learning rate the tower's matrices grew one shared direction until
every vision token was the same vector (`config.train.vision_lr_multiplier`).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests.train_runs import ROOT, run_train
from tests.vl_checkpoints import vl_checkpoint  # noqa: F401  (the session fixture)

_spec = importlib.util.spec_from_file_location("make_vision_tasks", ROOT / "data" / "make_vision_tasks.py")
make_vision_tasks = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = make_vision_tasks  # its dataclass (Task) looks its module up while the class is made
_spec.loader.exec_module(make_vision_tasks)

pytestmark = pytest.mark.heavy

STEPS = 300  # the budget for the left/right task
# The from-scratch runs' rows: a record is one row of ~65 tokens (16 vision tokens, the question, the answer and
# the template), never packed; configs/vflash.py's 192 would make two thirds of each row padding: the same
# updates in 2.4x the time (benchmarks/vision_learning.py fits its rows the same way).
SCRATCH_ROWS = "--config.data.seq_len=80"


@pytest.fixture(scope="module")
def left_right(tmp_path_factory) -> dict[str, Path]:
    """400 training and 100 test records; `blank`: the same records with the training discs removed."""
    root = tmp_path_factory.mktemp("vision_tasks")
    return {"images": make_vision_tasks.make("leftright", root / "images", 400, 100, seed=0)["train"].parent,
            "blank": make_vision_tasks.make("leftright", root / "blank", 400, 100, seed=0, blank=True)["train"].parent}


def train_and_report(config: str, workdir: Path, data: Path, steps: int, *overrides: str, timeout: int = 900):
    """Train `config` on `data`'s train.jsonl, evaluate at the end on its eval.jsonl → (report, CLI result)."""
    result = run_train(config, workdir, "--config.data.format=vflash", "--config.data.eval_format=vflash",
                       f"--config.data.train={data / 'train.jsonl'}",
                       f"--config.data.eval={data / 'eval.jsonl'}", f"--config.train.steps={steps}",
                       f"--config.train.checkpoint_every={steps}", "--config.eval.every=0",
                       "--config.eval.at_end=True", "--config.eval.max_examples=100", *overrides, timeout=timeout)
    return json.loads((workdir / "eval" / f"report-{steps}.json").read_text()), result


def point_accuracy(report: dict) -> float:
    return report["metrics"]["overall"]["point"]["accuracy"]


def test_configs_vflash_learns_left_or_right_from_scratch_and_its_answers_follow_the_image(left_right, tmp_path):
    report, _ = train_and_report("configs/vflash.py", tmp_path / "run", left_right["images"], STEPS, SCRATCH_ROWS)
    assert report["examples"] == 100
    assert point_accuracy(report) >= 0.98
    reliance = report["image_reliance"]
    assert reliance["compared"] == 100 and reliance["unswappable"] == 0
    # Where the other record's disc is on the other side, the answer moves with it.
    assert reliance["differing"] > 30 and reliance["reliance"] >= 0.95
    assert reliance["drop"] > 0.3


def test_a_model_trained_without_the_disc_answers_from_the_text_and_is_reported_blind(left_right, tmp_path):
    # Fewer steps suffice: there is nothing to learn beyond the answer's format and its prior.
    report, result = train_and_report("configs/vflash.py", tmp_path / "blind", left_right["blank"], 100, SCRATCH_ROWS)
    reliance = report["image_reliance"]
    assert reliance["compared"] == 100
    assert reliance["changed_fraction"] <= 0.05 and reliance["reliance"] <= 0.05
    assert point_accuracy(report) <= 0.7  # the majority side at best (60 of the 100 test discs)
    assert "image reliance:" in result.stderr and "the model answers from the text" in result.stderr


def test_an_imported_qwen2_5_vl_checkpoint_fine_tunes_to_left_or_right(left_right, vl_checkpoint, tmp_path):  # noqa: F811
    base, _ = vl_checkpoint("qwen2_5_vl")
    report, _ = train_and_report("configs/vflash.py:hf", tmp_path / "qwen", left_right["images"], STEPS,
                                 f"--config.model.init_from={base}", f"--config.data.tokenizer={base}",
                                 "--config.model.dtype=float32", "--config.model.remat=none",
                                 "--config.train.learning_rate=3e-3", "--config.train.warmup_steps=20",
                                 "--config.data.seq_len=256")
    assert point_accuracy(report) >= 0.98
    assert report["image_reliance"]["reliance"] >= 0.95

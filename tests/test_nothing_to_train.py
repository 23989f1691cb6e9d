"""Issue 27: a run with nothing to train is refused at start-up with the counts found, and a refused start-up
leaves its workdir as it found it (valen_jax/training/startup.py). The commands' own rows are in
tests/test_cli_errors.py; here the pieces, in process."""

from __future__ import annotations

import types
from pathlib import Path

import ml_collections
import pytest

from data_pipeline import conversion
from tests.train_runs import ROOT
from valen_jax.data.sources import ShardSet
from valen_jax.errors import NothingToTrain
from valen_jax.training.startup import start_up
from valen_jax.vflash.task import DrafterTask, trainable_blocks

TOKENIZER = ROOT / "data/tokenizer"
VFLASH = ROOT / "data/smoke/vflash"


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("nothing")

    def convert(name: str) -> ShardSet:
        conversion.convert("vflash", VFLASH / f"{name}.jsonl", out / name, TOKENIZER, progress=False)
        return ShardSet.open(out / name)

    return {name: convert(name) for name in ("points", "boxes", "robot2d")}


def _drafter_on(train_set, path: str) -> DrafterTask:
    """A DrafterTask with only what check_trainable reads (no target is restored for a count)."""
    task = DrafterTask.__new__(DrafterTask)
    task.train_set = train_set
    task.config = ml_collections.ConfigDict({"data": {"train": path}, "train": {"mode": "vflash"}})
    return task


def test_points_and_boxes_give_a_drafter_nothing_to_train_with_the_counts_found(shards):
    assert trainable_blocks(shards["points"]) == {"records": 28, "blocks": 0, "weighted_blocks": 0}
    mixture = [(shards["points"], 1.0), (shards["boxes"], 2.0)]
    assert trainable_blocks(mixture) == {"records": 48, "blocks": 0, "weighted_blocks": 0}
    with pytest.raises(NothingToTrain, match=r"'points.jsonl': nothing to train for the drafter \(train.mode=vflash\): "
                                             r"28 records, 0 primitive blocks"):
        _drafter_on(shards["points"], "points.jsonl").check_trainable()


def test_one_weighted_block_is_enough_and_the_count_stops_there(shards):
    found = trainable_blocks([(shards["points"], 1.0), (shards["robot2d"], 1.0)])
    assert found["weighted_blocks"] == 1 and found["blocks"] >= 1
    assert 28 < found["records"] < 28 + len(shards["robot2d"])  # stopped inside robot2d, at its first block
    _drafter_on(shards["robot2d"], "robot2d.jsonl").check_trainable()


def test_a_token_task_without_a_supervised_token_is_refused_with_its_counts(shards):
    from valen_jax.tasks.token_lm import TokenLMTask  # the Task protocol's own check_trainable

    manifest = types.SimpleNamespace(data={"counts": {"records": 3, "tokens": 120, "supervised_tokens": 0}})
    task = TokenLMTask.__new__(TokenLMTask)
    task.train_set = ShardSet(Path("x"), manifest)
    task.config = ml_collections.ConfigDict({"data": {"train": "rows.jsonl"}, "train": {"mode": "ar"}})
    with pytest.raises(NothingToTrain, match=r"'rows.jsonl': nothing to train \(train.mode=ar\): 3 records, "
                                             r"120 tokens, 0 supervised tokens"):
        task.check_trainable()
    task.train_set = shards["points"]
    task.check_trainable()


def _refused_start_up(workdir: Path, write) -> None:
    with pytest.raises(NothingToTrain), start_up(workdir) as note:
        workdir.mkdir(parents=True, exist_ok=True)
        with note.undone_on_error():
            write(workdir)
            raise NothingToTrain("refused")


def _writes(workdir: Path) -> None:
    (workdir / "train.lock").write_text("pid 1\n")
    (workdir / "shards" / "new-cache").mkdir(parents=True)
    (workdir / "shards" / "new-cache" / "manifest.json").write_text("{}")
    (workdir / "tokenizer").mkdir()
    (workdir / "checkpoints").mkdir(exist_ok=True)


def test_a_refused_start_up_on_a_fresh_workdir_leaves_no_workdir(tmp_path):
    _refused_start_up(tmp_path / "fresh" / "wd", _writes)
    assert not (tmp_path / "fresh" / "wd").exists()


def test_a_refused_start_up_keeps_what_was_there_and_what_training_owns(tmp_path):
    workdir = tmp_path / "wd"
    (workdir / "shards" / "old-cache").mkdir(parents=True)
    (workdir / "metrics.jsonl").write_text("{}\n")
    (workdir / "checkpoints" / "4").mkdir(parents=True)

    def writes(wd: Path) -> None:
        _writes(wd)
        (wd / "checkpoints-corrupt" / "4-x").mkdir(parents=True)  # a damaged step moved aside: kept

    _refused_start_up(workdir, writes)
    assert sorted(str(p.relative_to(workdir)) for p in workdir.rglob("*")) == [
        "checkpoints", "checkpoints-corrupt", "checkpoints-corrupt/4-x", "checkpoints/4", "metrics.jsonl",
        "shards", "shards/old-cache"]


def test_a_started_run_keeps_everything(tmp_path):
    workdir = tmp_path / "wd"
    with pytest.raises(RuntimeError), start_up(workdir) as note:
        workdir.mkdir()
        with note.undone_on_error():
            _writes(workdir)
            note.started()
            raise RuntimeError("after the first step")
    assert (workdir / "train.lock").exists() and (workdir / "shards" / "new-cache").is_dir()

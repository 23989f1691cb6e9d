"""Train/eval separation on shards (seed 003, issue 17): duplicate examples, shared Valen group_ids,
shared media digests and shared vakforge conversations are one ConfigError naming counts and the
first examples (file:line), unless allow_overlap, which returns the counts; a run refuses overlap
before the train step compiles, and with allow_overlap records the counts in meta and metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from data_pipeline import conversion
from valen_jax.config.schema import ConfigError
from valen_jax.data.separation import check_separation
from valen_jax.data.sources import ShardSet

ROOT = Path(__file__).resolve().parent.parent
SMOKE = ROOT / "data" / "smoke"
TOKENIZER = ROOT / "data" / "tokenizer"


def _shards(tmp_path: Path, name: str, fmt: str, source: Path, **options) -> ShardSet:
    out = tmp_path / f"shards-{name}"
    conversion.convert(fmt, source, out, TOKENIZER, overwrite=True, progress=False, options=options or None)
    return ShardSet.open(out)


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def valen_sets(tmp_path_factory):
    """Smoke train; held-out eval; a file repeating train's record 1 under a new group (same content) and
    its image record's group_id on another state; the text subset (same records, same groups)."""
    tmp = tmp_path_factory.mktemp("separation")
    records = [json.loads(line) for line in (SMOKE / "valen" / "train.jsonl").read_text().splitlines()]
    image = next(r for r in records if r["meta"]["modality"] == "image")
    regrouped = dict(records[0], group_id="renamed-traffic")
    same_group = dict(records[1], group_id=image["group_id"],
                      request=dict(records[1]["request"], state="A paraphrase of the image record's material."))
    (tmp / "assets").symlink_to(SMOKE / "valen" / "assets")
    leaky = _write(tmp / "leaky.jsonl", [regrouped, same_group])
    return {"train": _shards(tmp, "train", "valen", SMOKE / "valen" / "train.jsonl"),
            "eval": _shards(tmp, "eval", "valen", SMOKE / "valen" / "eval.jsonl"),
            "leaky": _shards(tmp, "leaky", "valen", leaky),
            "text": _shards(tmp, "text", "valen", SMOKE / "valen" / "text.jsonl")}


def test_held_out_valen_set_is_separate(valen_sets):
    assert check_separation(valen_sets["train"], valen_sets["eval"], allow_overlap=False) == {}


def test_same_content_under_another_group_and_a_shared_group_id_are_refused(valen_sets):
    with pytest.raises(ConfigError) as error:
        check_separation(valen_sets["train"], valen_sets["leaky"], allow_overlap=False)
    message = str(error.value)
    assert "1 duplicate examples" in message and "1 shared group ids" in message
    assert "train/train.jsonl:1" in message.replace(str(SMOKE / "valen"), "train")  # the first train example
    assert "leaky.jsonl:1" in message and "leaky.jsonl:2" in message
    assert "config.data.allow_overlap=True" in message


def test_allow_overlap_returns_the_counts(valen_sets):
    counts = check_separation(valen_sets["train"], valen_sets["text"], allow_overlap=True)
    # text.jsonl is the 4 text records of train.jsonl: same examples, same groups, no media.
    assert counts == {"duplicate_examples": 4, "shared_group_ids": 4}


def test_chat_smoke_eval_repeats_training_rows_and_an_image(tmp_path):
    train = _shards(tmp_path, "train", "chat", SMOKE / "chat" / "train.jsonl")
    held = _shards(tmp_path, "eval", "chat", SMOKE / "chat" / "eval.jsonl")
    with pytest.raises(ConfigError, match=r"2 duplicate examples: .*\| 1 shared media: .*chat/eval.jsonl:4"):
        check_separation(train, held, allow_overlap=False)


def test_vakforge_shared_conversation_ids(tmp_path):
    train = _shards(tmp_path, "train", "vakforge", SMOKE / "vakforge" / "vakforge.jsonl", split="train")
    test = _shards(tmp_path, "test", "vakforge", SMOKE / "vakforge" / "vakforge.jsonl", split="test")
    assert check_separation(train, test, allow_overlap=False) == {}
    counts = check_separation(train, train, allow_overlap=True)
    assert counts["shared_conversations"] == 2 and counts["duplicate_examples"] == 2


@pytest.mark.slow
def test_a_run_refuses_overlap_before_compiling_and_records_allowed_overlap(tmp_path):
    from tests.train_runs import metrics, run_train
    from valen_jax.training import checkpoint

    same = (f"--config.data.eval={SMOKE / 'valen' / 'text.jsonl'}", f"--config.data.train={SMOKE / 'valen' / 'text.jsonl'}",
            "--config.train.steps=1", "--config.train.checkpoint_every=1", "--config.eval.at_end=False")
    refused = run_train("configs/valen.py:tiny", tmp_path / "refused", *same, check=False)
    assert refused.returncode != 0
    assert "ConfigError: config.data.train" in refused.stderr and "4 duplicate examples" in refused.stderr
    assert "compiled the train step" not in refused.stderr
    workdir = tmp_path / "allowed"
    run_train("configs/valen.py:tiny", workdir, *same, "--config.data.allow_overlap=True")
    meta = checkpoint.restore_meta(checkpoint.manager(workdir, read_only=True), 1)
    assert meta["train_eval_overlap"] == {"duplicate_examples": 4, "shared_group_ids": 4}
    first = metrics(workdir)[0]
    assert first["overlap_duplicate_examples"] == 4 and first["overlap_shared_group_ids"] == 4

"""Generated answers carry the record's `id` (issue 54, failure 5: `generate` dropped a VFlash record's id).

A VFlash record's `id` travels in its Example (`record_id`, not `id`: VFlash ids are the user's labels, not
the vakforge conversation identities the train/eval separation compares) to every answer line, as the
vakforge conversation id always did and as `predict` carries a Valen record's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from data_pipeline.conversion import convert
from data_pipeline.examples import meta_of
from data_pipeline.shards import read_shard
from data_pipeline.tokenizer import end_of_turn_id, load_tokenizer
from tests.train_runs import ROOT, run_module
from valen_jax.evaluation import answers

VFLASH = ROOT / "data" / "smoke" / "vflash"


def vflash_with_ids(folder: Path, ids: list) -> Path:
    """The smoke eval file's first records with these ids (their images copied beside it)."""
    shutil.copytree(VFLASH / "images", folder / "images")
    rows = [json.loads(line) for line in (VFLASH / "eval.jsonl").read_text().splitlines()][:len(ids)]
    data = folder / "eval.jsonl"
    data.write_text("".join(json.dumps({**({"id": i} if i is not None else {}), **row}) + "\n"
                            for i, row in zip(ids, rows, strict=True)))
    return data


def test_a_vflash_records_id_reaches_its_answer_line(tmp_path):
    data = vflash_with_ids(tmp_path, ["cup-7", 12, None])
    manifest = convert("vflash", data, tmp_path / "shards", str(ROOT / "data" / "tokenizer"), progress=False)
    examples = [e for path in manifest.shard_paths for e in read_shard(tmp_path / "shards" / path)]
    tokenizer = load_tokenizer(ROOT / "data" / "tokenizer")
    eot = end_of_turn_id(tokenizer)
    ids = [meta_of(e).record_id for e in examples]
    assert ids == ["cup-7", 12, None]
    lines = [answers.answer_line(e, i, 0, [eot], family="vflash", tokenizer=tokenizer, stop_ids=(eot,),
                                 chat_family=None) for i, e in enumerate(examples)]
    assert [line["id"] for line in lines] == ["cup-7", 12, None]
    # Not the vakforge conversation id: equal VFlash ids in train and eval are no overlap.
    assert all(meta_of(e).id is None for e in examples)


@pytest.mark.heavy
def test_the_generate_command_writes_the_records_ids(tmp_path_factory, tmp_path):
    from tests.smoke_workdirs import smoke_workdir

    workdir = smoke_workdir(tmp_path_factory, "configs/vflash.py:tiny")
    data = vflash_with_ids(tmp_path, ["first", 2])
    output = tmp_path / "answers.jsonl"
    run_module("valen_jax.generate", f"--workdir={workdir}", f"--data={data}", f"--output={output}",
               "--max-new-tokens=2", timeout=600)
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    assert [(line["index"], line["id"]) for line in lines] == [(0, "first"), (1, 2)]

"""Prepared token rows → Examples stored as given, after the run's checks (seed 003, "Prepared token rows").

Real Parquet files (pyarrow) in real zips (`write_prepared_zip`), converted with `convert` and the CLI.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from data_pipeline.chat_templates import CHATML
from data_pipeline.conversion import convert
from data_pipeline.formats.errors import FormatError
from data_pipeline.formats.prepared import PreparedDescriptor, PreparedFile, file_sha256, write_prepared_zip
from data_pipeline.formats.prepared_load import PreparedRow, read_prepared_rows
from data_pipeline.formats.prepared_rows import scan_rows
from data_pipeline.render.prepared import PreparedRenderer
from data_pipeline.shards import Manifest, read_shard
from data_pipeline.tokenizer import fingerprint, load_tokenizer
from tests.train_runs import ROOT

TOKENIZER = ROOT / "data/tokenizer"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
TRAIN = ([[5, 6, 7, 8], [9, 10, 11]], [[0, 0, 1, 1], [0, 1, 1]])
MORE = ([[1, 2], [3, 4, 5]], [[0, 1], [0, 0, 1]])


def parquet(path: Path, ids: list, masks: list) -> Path:
    pq.write_table(pa.table({"input_ids": pa.array(ids, pa.list_(pa.int64())),
                             "loss_mask": pa.array(masks, pa.list_(pa.int8())),
                             "note": pa.array(["ignored"] * len(ids))}), path)
    return path


def prepared_zip(tmp_path: Path, tokenizer, name: str = "train.zip", train=TRAIN, more=MORE) -> Path:
    """A registered-style zip: two files, descriptor digests from `tokenizer`."""
    files = [parquet(tmp_path / "train.parquet", *train), parquet(tmp_path / "more.parquet", *more)]
    entries = []
    for path in files:
        stats, problems = scan_rows(path, str(path))
        assert not problems
        entries.append(PreparedFile(path.name, file_sha256(path), stats))
    fp = fingerprint(tokenizer)
    descriptor = PreparedDescriptor("org/model", COMMIT, fp.tokenizer_sha256, fp.chat_template_sha256, tuple(entries))
    out = tmp_path / name
    write_prepared_zip(descriptor, files, out)
    return out


@pytest.fixture(scope="module")
def shipped():
    return AutoTokenizer.from_pretrained(str(TOKENIZER))


def bare_tokenizer(directory: Path) -> Path:
    """A ChatML tokenizer WITHOUT the primitive tokens, so load_tokenizer changes its digest."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    backend.train_from_iterator(["a few words for a tiny vocabulary"] * 5,
                                trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                                    "<|im_end|>"],
                                                    initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = CHATML
    tok.save_pretrained(str(directory))
    return directory


def examples_of(out: Path) -> list:
    manifest = Manifest.read(out)
    return [e for p in manifest.shard_paths for e in read_shard(out / p)]


def test_rows_are_stored_as_given(tmp_path, shipped):
    archive = prepared_zip(tmp_path, shipped)
    manifest = convert("prepared", archive, tmp_path / "out", TOKENIZER, progress=False)
    examples = examples_of(tmp_path / "out")
    rows = list(zip(*TRAIN, strict=True)) + list(zip(*MORE, strict=True))  # the descriptor's (training) order
    assert len(examples) == len(rows) == manifest.data["counts"]["records"]
    for example, (ids, mask) in zip(examples, rows, strict=True):
        assert example.arrays["input_ids"].dtype == np.int32 and example.arrays["input_ids"].tolist() == ids
        assert example.arrays["target_weights"].dtype == np.float32
        assert example.arrays["target_weights"].tolist() == [float(m) for m in mask]
        assert set(example.arrays) == {"input_ids", "target_weights"}
    assert [(e.meta["source"], e.meta["line"]) for e in examples] == [
        (f"{archive}/train.parquet", 1), (f"{archive}/train.parquet", 2),
        (f"{archive}/more.parquet", 1), (f"{archive}/more.parquet", 2)]
    assert examples[0].meta["format"] == "prepared"
    counts = manifest.data["counts"]
    assert (counts["tokens"], counts["supervised_tokens"], counts["longest_example"]) == (12, 6, 4)
    stated = manifest.data["prepared"]
    assert stated["tokenizer"] == {"repository": "org/model", "revision": COMMIT}
    assert [f["path"] for f in stated["files"]] == ["train.parquet", "more.parquet"]
    assert manifest.data["sources"] == [{"path": "train.zip", "sha256": file_sha256(archive), "entry": "train"}]
    assert manifest.data["options"] == {"records_per_shard": 512, "max_seq_length": None}


def test_a_directory_is_converted_like_its_zip(tmp_path, shipped):
    archive = prepared_zip(tmp_path, shipped)
    folder = tmp_path / "unzipped"
    with zipfile.ZipFile(archive) as zf:
        zf.extractall(folder)
    convert("prepared", archive, tmp_path / "a", TOKENIZER, progress=False)
    convert("prepared", folder, tmp_path / "b", TOKENIZER, progress=False)
    strip = [(e.arrays["input_ids"].tolist(), e.arrays["target_weights"].tolist(), e.meta["line"])
             for e in examples_of(tmp_path / "a")]
    assert strip == [(e.arrays["input_ids"].tolist(), e.arrays["target_weights"].tolist(), e.meta["line"])
                     for e in examples_of(tmp_path / "b")]


def test_digests_are_checked_against_the_tokenizer_as_shipped(tmp_path):
    path = bare_tokenizer(tmp_path / "bare")
    as_shipped = AutoTokenizer.from_pretrained(str(path))
    training = load_tokenizer(path)  # adds the primitive tokens: another tokenizerSha256
    assert fingerprint(training).tokenizer_sha256 != fingerprint(as_shipped).tokenizer_sha256
    archive = prepared_zip(tmp_path, as_shipped)
    manifest = convert("prepared", archive, tmp_path / "out", path, progress=False)
    # The shards themselves are tied to the training tokenizer, like every other format's.
    assert manifest.fingerprint == fingerprint(training).to_json()
    assert manifest.data["prepared"]["tokenizerSha256"] == fingerprint(as_shipped).tokenizer_sha256


def test_rows_of_another_tokenizer_are_refused(tmp_path, shipped):
    archive = prepared_zip(tmp_path, shipped)
    with pytest.raises(FormatError) as info:
        convert("prepared", archive, tmp_path / "out", bare_tokenizer(tmp_path / "bare"), progress=False)
    (problem,) = info.value.problems
    assert problem.path == f"{archive}/prepared.json" and problem.field == "tokenizerSha256"
    assert problem.message.startswith("prepared with another tokenizer")
    assert not (tmp_path / "out").exists()


def test_max_seq_length(tmp_path, shipped):
    archive = prepared_zip(tmp_path, shipped)
    with pytest.raises(FormatError, match="train.parquet:0: longestRow: 4 tokens, longer than maxSeqLength 3"):
        convert("prepared", archive, tmp_path / "short", TOKENIZER, progress=False, options={"max_seq_length": 3})
    manifest = convert("prepared", archive, tmp_path / "ok", TOKENIZER, progress=False, options={"max_seq_length": 4})
    assert manifest.data["options"]["max_seq_length"] == 4


def test_ids_outside_the_shipped_vocabulary_are_refused(tmp_path, shipped):
    archive = prepared_zip(tmp_path, shipped, more=([[1, 2], [3, 4, len(shipped)]], MORE[1]))
    with pytest.raises(FormatError) as info:
        convert("prepared", archive, tmp_path / "out", TOKENIZER, progress=False)
    (problem,) = info.value.problems
    assert (problem.path, problem.line, problem.field) == (f"{archive}/more.parquet", 2, "input_ids")
    assert f"outside the tokenizer's vocabulary of {len(shipped)}" in problem.message


def test_a_changed_file_is_refused(tmp_path, shipped):
    archive = prepared_zip(tmp_path, shipped)
    tampered = tmp_path / "tampered.zip"
    with zipfile.ZipFile(archive) as src, zipfile.ZipFile(tampered, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename == "more.parquet":
                data = parquet(tmp_path / "other.parquet", [[1, 2]], [[0, 1]]).read_bytes()
            dst.writestr(info, data)
    with pytest.raises(FormatError, match="more.parquet:0: sha256: the file's SHA-256 is"):
        read_prepared_rows(tampered)


def test_a_loss_policy_is_refused_for_prepared_rows(tmp_path, shipped):
    # Seed 003: a run "does not apply a loss policy" to prepared rows and refuses one that states one.
    archive = prepared_zip(tmp_path, shipped)
    with pytest.raises(ValueError, match="--assistant-turns: not an option of --format=prepared"):
        convert("prepared", archive, tmp_path / "out", TOKENIZER, progress=False, options={"assistant_turns": "last"})


def test_renderer_casts_without_changing_values(shipped):
    row = PreparedRow("x.zip/a.parquet", 1, np.array([7, 8, 2130], np.int64), np.array([0, 1, 0], np.int8))
    example = PreparedRenderer(shipped).render(row, "e")
    assert example.arrays["input_ids"].dtype == np.int32 and example.arrays["input_ids"].tolist() == [7, 8, 2130]
    assert example.arrays["target_weights"].tolist() == [0.0, 1.0, 0.0]
    assert example.meta == {"format": "prepared", "source": "x.zip/a.parquet", "line": 1, "entry": "e"}


def test_convert_prepared_is_byte_identical_whatever_the_worker_count(tmp_path, shipped):
    archive = prepared_zip(tmp_path, shipped)
    one = convert("prepared", archive, tmp_path / "one", TOKENIZER, workers=1, progress=False)
    two = convert("prepared", archive, tmp_path / "two", TOKENIZER, workers=2, progress=False)
    assert one.data == two.data
    for name in [*one.shard_paths, "manifest.json"]:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()


@pytest.mark.slow
def test_convert_cli_prepared(tmp_path, shipped):
    def run(archive: Path, out: str, *flags: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "data_pipeline.convert", "--format=prepared", f"--input={archive}",
               f"--output={tmp_path / out}", f"--tokenizer={TOKENIZER}", *flags]
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)

    good = prepared_zip(tmp_path, shipped)
    result = run(good, "out", "--max-seq-length=8")
    assert result.returncode == 0, result.stderr
    assert "4 records, 12 tokens, 6 supervised, longest 4" in result.stdout

    other = tmp_path / "other"
    other.mkdir()
    bad = prepared_zip(other, AutoTokenizer.from_pretrained(str(bare_tokenizer(tmp_path / "bare"))))
    result = run(bad, "bad_out")
    assert result.returncode == 1
    assert result.stderr.startswith(f"{bad}/prepared.json:0: tokenizerSha256: prepared with another tokenizer")
    assert not (tmp_path / "bad_out").exists()

    result = run(good, "long_out", "--max-seq-length=2")
    assert result.returncode == 1 and "longer than maxSeqLength 2" in result.stderr

"""`--runner=beam` (DirectRunner, one in-memory worker) gives the local runner's shards and manifest, byte for byte.

apache-beam comes from the `beam` extra, which requirements-test.lock (and so `make test` and CI) installs.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from data_pipeline import format_registry as registry
from data_pipeline.beam_convert import IndexedBytesSink, _read_gathered, convert_beam, pipeline_options
from data_pipeline.conversion import convert
from data_pipeline.convert import main
from data_pipeline.render.common import RenderError
from data_pipeline.shards import Manifest, read_shard
from tests.train_runs import ROOT

TOKENIZER = ROOT / "data/tokenizer"
CASES = {"recipe": ROOT / "data/smoke/vflash/recipe.json", "valen": ROOT / "data/smoke/valen/train.jsonl"}


def _files(out) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


@pytest.mark.parametrize("fmt", sorted(CASES))
def test_beam_direct_runner_writes_the_local_bytes(tmp_path, fmt, capsys):
    local = convert(fmt, CASES[fmt], tmp_path / "local", TOKENIZER, progress=False)
    code = main([f"--format={fmt}", f"--input={CASES[fmt]}", f"--output={tmp_path / 'beam'}",
                 f"--tokenizer={TOKENIZER}", "--runner=beam", "--beam-runner=DirectRunner",
                 "--beam-option", "direct_num_workers=1"])
    assert code == 0, capsys.readouterr().err
    # Same shard files and manifest.json (the runner is not recorded: it does not change the output).
    assert _files(tmp_path / "beam") == _files(tmp_path / "local")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["beam", "local"]  # gather/staging dirs are gone
    examples = [e for p in local.shard_paths for e in read_shard(tmp_path / "beam" / p)]
    assert len(examples) == Manifest.read(tmp_path / "beam").data["counts"]["records"] > 0


def test_a_record_refused_on_a_worker_is_reported_as_the_local_runner_does(tmp_path, monkeypatch):
    valen = registry.FORMATS["valen"]

    class Refusing:
        def __init__(self, tokenizer):
            self.inner = valen.make_renderer(tokenizer)

        def render(self, record, entry):
            if record.line >= 3:
                raise RenderError("train.jsonl", record.line, "questions", "refused")
            return self.inner.render(record, entry)

    # In-memory DirectRunner: the DoFn runs in this process and sees the patched registry.
    monkeypatch.setitem(registry.FORMATS, "refusing", dataclasses.replace(valen, make_renderer=Refusing))
    with pytest.raises(RenderError) as local:
        convert("refusing", CASES["valen"], tmp_path / "local", TOKENIZER, progress=False)
    with pytest.raises(RenderError) as beam:
        convert_beam("refusing", CASES["valen"], tmp_path / "beam", TOKENIZER)
    assert str(beam.value) == str(local.value) == "train.jsonl:3: questions: refused"
    assert list(tmp_path.iterdir()) == []


def test_gathered_records_come_back_in_index_order_and_complete(tmp_path):
    def gather(name, records):
        sink = IndexedBytesSink()
        with open(tmp_path / name, "wb") as handle:
            sink.open(handle)
            for record in records:
                sink.write(record)
            sink.flush()

    gather("rendered-b", [(2, 0, b"two"), (0, 0, b"zero")])
    gather("rendered-a", [(1, 0, b"one"), (0, 0, b"zero")])  # a duplicate with the same bytes is harmless
    assert _read_gathered(str(tmp_path), 3) == [b"zero", b"one", b"two"]
    with pytest.raises(ValueError, match="1 of 4 records did not come back"):
        _read_gathered(str(tmp_path), 4)
    gather("rendered-c", [(1, 0, b"ONE")])
    with pytest.raises(ValueError, match="record 1 came back twice with different bytes"):
        _read_gathered(str(tmp_path), 3)


def test_beam_flags_are_refused_where_they_do_not_apply(tmp_path, capsys):
    base = ["--format=valen", f"--input={CASES['valen']}", f"--output={tmp_path / 'out'}", f"--tokenizer={TOKENIZER}"]
    assert main([*base, "--beam-option", "direct_num_workers=2"]) == 1
    assert "need --runner=beam" in capsys.readouterr().err
    assert main([*base, "--runner=beam", "--workers=2"]) == 1
    assert "direct_num_workers" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="--beam-runner"):
        pipeline_options("DirectRunner", {"runner": "FlinkRunner"})
    options = pipeline_options("DirectRunner", {"save_main_session": None}).get_all_options()
    assert options["direct_running_mode"] == "in_memory" and options["save_main_session"] is True


def test_importing_the_converters_leaves_the_root_logger_alone_and_has_no_cycle():
    # apache_beam logs a warning at import; our modules must not let that configure the root logger
    # (an application's logging is its own), and the library must not import its CLI.
    code = ("import logging, sys\n"
            "import data_pipeline.beam_convert, data_pipeline.conversion, data_pipeline.format_registry\n"
            "assert logging.getLogger().handlers == [], logging.getLogger().handlers\n"
            "assert 'data_pipeline.convert' not in sys.modules, 'the library imported its CLI'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0 and result.stderr == "", result.stderr

"""One format registry (data_pipeline/format_registry.py): validate, convert and evaluation read it,
so a format registered there is validated, converted and evaluated with nothing else to edit."""

from __future__ import annotations

import dataclasses

import pytest

from data_pipeline import convert, examples, validate
from data_pipeline import format_registry as registry
from data_pipeline.shards import Manifest
from tests.train_runs import ROOT

VALEN = ROOT / "data/smoke/valen/train.jsonl"


def test_every_format_says_what_each_stage_needs():
    assert list(registry.FORMATS) == ["valen", "vflash", "recipe", "chat", "vakforge", "prepared"]
    for spec in registry.FORMATS.values():
        assert spec.kind in examples.KINDS and spec.family in registry.FORMATS
        assert callable(spec.validate) and callable(spec.load) and callable(spec.make_renderer)
    assert registry.FORMATS["recipe"].family == "vflash"
    # Each option a format takes is declared once, so convert's command line offers it.
    assert registry.undeclared_options() == []
    assert registry.takers("assistant_turns") == {"chat": "all", "vakforge": "all"}
    with pytest.raises(ValueError, match="format 'csv': choose one of valen, vflash"):
        registry.get("csv")
    with pytest.raises(ValueError, match="kind='text'"):
        dataclasses.replace(registry.FORMATS["chat"], kind="text")


def test_a_format_added_to_the_registry_alone_validates_and_converts(tmp_path, monkeypatch, capsys):
    # The registry entry is the only edit: both CLIs take their --format choices and behaviour from it.
    monkeypatch.setitem(registry.FORMATS, "valen_copy", registry.FORMATS["valen"])
    assert validate.main(["--format=valen_copy", str(VALEN)]) == 0
    assert capsys.readouterr().out.startswith(f"{VALEN}: ")
    assert convert.main(["--format=valen_copy", f"--input={VALEN}", f"--output={tmp_path / 'out'}",
                         f"--tokenizer={ROOT / 'data/tokenizer'}"]) == 0
    assert Manifest.read(tmp_path / "out").data["format"] == "valen_copy"


def test_options_a_format_does_not_take_are_refused_by_both_clis(tmp_path, capsys):
    with pytest.raises(SystemExit):
        validate.main(["--format=valen", "--allow-unconsented", str(VALEN)])
    assert "--allow-unconsented applies to --format=vakforge only" in capsys.readouterr().err
    assert convert.main(["--format=valen", f"--input={VALEN}", f"--output={tmp_path / 'out'}",
                         f"--tokenizer={ROOT / 'data/tokenizer'}", "--split=train"]) == 1
    assert "--split: not an option of --format=valen" in capsys.readouterr().err


def test_the_flow_has_no_back_edges():
    # DESIGN "one direction": formats → render → conversion; the registry sits above formats and
    # render, so neither may import it, and data_pipeline never imports valen_jax.
    back_edges = []
    for path in sorted((ROOT / "data_pipeline").rglob("*.py")):
        text = path.read_text()
        lower = path.parent.name in ("formats", "render")
        if (lower and "format_registry" in text) or "import valen_jax" in text or "from valen_jax" in text:
            back_edges.append(str(path.relative_to(ROOT)))
    assert back_edges == []

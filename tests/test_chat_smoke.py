"""The chat smoke set regenerates byte-identically and validates."""

from __future__ import annotations

import importlib.util

from data_pipeline.formats.chat import chat_diagnostics, read_chat
from tests.train_runs import ROOT


def test_chat_smoke_set_is_reproducible_and_valid(tmp_path):
    spec = importlib.util.spec_from_file_location("make_chat_smoke", ROOT / "data/make_chat_smoke.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--out", str(tmp_path)])
    committed = ROOT / "data/smoke/chat"
    made = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert made == sorted(p.relative_to(committed) for p in committed.rglob("*") if p.is_file())
    for name in made:
        assert (tmp_path / name).read_bytes() == (committed / name).read_bytes(), name
    records = read_chat(committed / "train.jsonl")
    diagnostics = chat_diagnostics(records)
    assert len(records) == 48 and diagnostics.tool_calls == 12 and diagnostics.rows_declaring_tools == 12

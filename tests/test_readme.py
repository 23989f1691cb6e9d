"""The README and docs/ as a user reads them (issue 27): links that resolve inside the repository (a fresh
clone has no ../shared/), Python snippets that import what exists and run as written, and the cheap
commands (validate on the smoke data) that exit 0.

Running a snippet "as written" needs its inputs: the HF snippet names a hub model and /tmp/export, the
generate snippet a trained /tmp/chat. The test swaps exactly those literals (each must still be in the
snippet, so an edited README fails here) for a tiny local checkpoint, a temp folder and the suite's tiny
chat workdir; nothing else of a snippet changes."""

from __future__ import annotations

import ast
import importlib
import re
import shlex
from pathlib import Path

import pytest

from tests.train_runs import ROOT, run_module

README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
_BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def blocks(path: Path, language: str) -> list[str]:
    return [body for lang, body in _BLOCK.findall(path.read_text(encoding="utf-8")) if lang == language]


def python_snippets() -> list[str]:
    return blocks(README, "python")


def _snippet(needle: str) -> str:
    (found,) = [s for s in python_snippets() if needle in s]
    return found


def _swap(snippet: str, **literals: str) -> str:
    for old, new in literals.items():
        assert old in snippet, f"the README snippet no longer names {old!r}; update tests/test_readme.py"
        snippet = snippet.replace(old, new)
    return snippet


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: p.name)
def test_links_resolve_inside_the_repository(doc):
    text = doc.read_text(encoding="utf-8")
    assert "../shared" not in text, f"{doc.name} points outside the repository (a clone has no ../shared/)"
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target:
            continue
        assert (doc.parent / target).exists(), f"{doc.name}: link to {target!r}, which does not exist"


def test_the_docs_exist_and_name_every_format():
    from data_pipeline.format_registry import FORMATS

    formats = (ROOT / "docs" / "formats.md").read_text(encoding="utf-8")
    for name in FORMATS:
        assert f"## {name}" in formats, f"docs/formats.md has no section for --format={name}"
    assert (ROOT / "docs" / "architecture.md").is_file()


@pytest.mark.parametrize("index", range(len(python_snippets())))
def test_every_python_snippet_compiles_and_imports_what_exists(index):
    tree = ast.parse(python_snippets()[index])
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)
        elif isinstance(node, ast.ImportFrom):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name) or importlib.util.find_spec(f"{node.module}.{alias.name}"), \
                    f"from {node.module} import {alias.name}: no such name"


def test_the_hf_snippet_runs(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    source = tmp_path / "qwen2"
    config = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(source)
    code = _swap(_snippet("hf.from_pretrained"), **{'"Qwen/Qwen2.5-0.5B"': repr(str(source)),
                                                    '"/tmp/export"': repr(str(tmp_path / "export"))})
    namespace: dict = {}
    exec(compile(code, "README.md (HF interop)", "exec"), namespace)  # noqa: S102 - the README's own code
    assert namespace["cfg"].dtype == "bfloat16"
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export")  # as the snippet's comment says


@pytest.mark.slow
def test_the_generate_snippet_runs(tmp_path_factory):
    from tests.smoke_workdirs import smoke_workdir

    workdir = smoke_workdir(tmp_path_factory, "configs/chat.py:tiny", "--config.train.steps=4")
    code = _swap(_snippet("from valen_jax.generate import generate"), **{'"/tmp/chat"': repr(str(workdir))})
    # The snippet's last two lines are expressions a notebook shows; keep their values to check them.
    lines = code.rstrip().splitlines()
    code = "\n".join([*lines[:-2], f"texts = {lines[-2].split('#')[0]}", f"ids = {lines[-1].split('#')[0]}"])
    namespace: dict = {}
    exec(compile(code, "README.md (generation)", "exec"), namespace)  # noqa: S102
    assert len(namespace["texts"]) == 1 and isinstance(namespace["texts"][0], str)
    assert len(namespace["ids"]) == 1 and all(isinstance(i, int) for i in namespace["ids"][0])


def validate_commands() -> list[tuple[str, str]]:
    """(document, command) of every `python -m data_pipeline.validate` line on committed smoke data."""
    found = []
    for doc in (README, *DOCS):
        for body in blocks(doc, "bash"):
            for line in body.splitlines():
                words = shlex.split(line.split("#")[0]) if "data_pipeline.validate" in line else []
                if words and all((ROOT / w).exists() for w in words[3:] if not w.startswith("-")) \
                        and any(w.startswith("data/smoke/") for w in words):
                    found.append((doc.name, line.strip()))
    return found


@pytest.mark.parametrize("doc, command", validate_commands())
def test_validate_commands_on_the_smoke_data_run_as_written(doc, command):
    words = shlex.split(command)
    assert words[0] in ("python", ".venv/bin/python") and words[1:3] == ["-m", "data_pipeline.validate"]
    result = run_module("data_pipeline.validate", *words[3:], check=False)  # forked from the warm parent
    assert result.returncode == 0, (doc, command, result.stderr[-2000:])


def test_the_validate_commands_are_found():
    commands = validate_commands()
    assert ("README.md", ".venv/bin/python -m data_pipeline.validate --format=recipe data/smoke/vflash/recipe.json") \
        in commands
    assert {doc for doc, _ in commands} == {"README.md", "formats.md"} and len(commands) >= 7

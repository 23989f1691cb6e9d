"""One flag helper for every CLI (issue 26, item 5): `data_pipeline.cli_flags.add_flag`.

Every multi-word flag of every argparse CLI parses in both spellings, `--max-new-tokens` and
`--max_new_tokens`, to the same namespace; help shows the hyphenated one only; and nothing else is
accepted (an unknown or half-converted flag is still argparse's error). The parsers are built by each
CLI's `build_parser()`, so no command runs.
"""

from __future__ import annotations

import argparse
import importlib
import re
from pathlib import Path

import pytest

from data_pipeline.cli_flags import add_flag

REPO = Path(__file__).resolve().parents[1]
CLIS = (
    "valen_jax.evaluate", "valen_jax.predict", "valen_jax.generate", "valen_jax.regenerate", "valen_jax.export",
    "valen_jax.serve",
    "data_pipeline.validate", "data_pipeline.convert", "data_pipeline.split", "data_pipeline.prepared",
    "data_pipeline.registry.__main__", "data_pipeline.vakforge.inspect", "data_pipeline.vakforge.prepare",
    "data_pipeline.vakforge.synth", "data_pipeline.vakforge.split",
)
UNDERSCORED = re.compile(r"--[a-z0-9]+_[a-z0-9_]*")


def test_every_argparse_cli_of_both_packages_is_listed_here():
    # valen_jax.train uses absl flags (--config, --workdir, the --config.field_name overrides): not argparse.
    found = set()
    for package in ("valen_jax", "data_pipeline"):
        for path in (REPO / package).rglob("*.py"):
            if "argparse.ArgumentParser(" in path.read_text(encoding="utf-8"):
                found.add(".".join(path.relative_to(REPO).with_suffix("").parts))
    assert found == set(CLIS)


def chains(parser: argparse.ArgumentParser, names: tuple[str, ...] = ()):
    """Every command of `parser`, subcommands included, as ((name, parser) for each level)."""
    levels = ((names[-1] if names else None, parser),)
    subcommands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subcommands:
        yield levels
        return
    for name, sub in subcommands[0].choices.items():
        for rest in chains(sub, (*names, name)):
            yield levels + rest


def spelled(action: argparse.Action, flag: str) -> list[str]:
    """`flag` (one of the action's spellings) with a value the action takes."""
    if action.nargs == 0:
        return [flag]
    if action.choices:
        return [f"{flag}={next(iter(action.choices))}"]
    return [f"{flag}={'3' if action.type in (int, float) else 'x'}"]


def argv_of(levels, flag: tuple[argparse.Action, str] | None = None) -> list[str]:
    """The shortest command line every level accepts, with `flag` (action, spelling) at its level."""
    argv = []
    for name, parser in levels:
        if name is not None:
            argv.append(name)
        for action in parser._actions:
            if action.option_strings and action.required and (flag is None or action is not flag[0]):
                argv += spelled(action, action.option_strings[-1])
        if flag is not None and flag[0] in parser._actions:
            argv += spelled(*flag)
        for action in parser._actions:
            if not action.option_strings and not isinstance(action, argparse._SubParsersAction) \
                    and action.nargs not in ("*", "?"):
                argv += ["x"]
    return argv


def multi_word_flags(levels):
    for _, parser in levels:
        for action in parser._actions:
            for flag in action.option_strings:
                if flag.startswith("--") and re.search(r"[-_]", flag[2:]):
                    yield action, flag


@pytest.mark.parametrize("module", CLIS)
def test_each_multi_word_flag_parses_in_both_spellings_to_the_same_namespace(module):
    parser = importlib.import_module(module).build_parser()
    checked = 0
    for levels in chains(parser):
        plain = parser.parse_args(argv_of(levels))
        for action, flag in multi_word_flags(levels):
            assert "_" not in flag, f"{module}: {flag} is shown with an underscore; register it with add_flag"
            alias = "--" + flag[2:].replace("-", "_")
            hyphenated = parser.parse_args(argv_of(levels, (action, flag)))
            underscored = parser.parse_args(argv_of(levels, (action, alias)))
            assert hyphenated == underscored, (module, flag)
            if not action.required:  # else the plain command line holds it too; parsing it alone is the check
                assert getattr(hyphenated, action.dest) != getattr(plain, action.dest), (module, flag)
            checked += 1
        for _, level in levels:
            assert not UNDERSCORED.findall(level.format_usage()), module
            for action in level._actions:
                assert not any(UNDERSCORED.fullmatch(s) for s in action.option_strings), (module, action)
    if module not in ("valen_jax.export", "data_pipeline.prepared", "data_pipeline.vakforge.inspect"):
        assert checked, f"{module}: no multi-word flag found"


@pytest.mark.parametrize("module", CLIS)
def test_an_unknown_or_half_converted_flag_is_still_an_error(module, capsys):
    parser = importlib.import_module(module).build_parser()
    for levels in chains(parser):
        for wrong in ("--no-such-flag", "--no_such_flag"):
            with pytest.raises(SystemExit) as exit_info:
                parser.parse_args([*argv_of(levels), wrong])
            assert exit_info.value.code == 2
            assert wrong in capsys.readouterr().err
        for action, flag in multi_word_flags(levels):
            if flag[2:].count("-") < 2:  # one separator only: no half-converted spelling
                continue
            mixed = "--" + flag[2:].replace("-", "_", 1)  # --max_new-tokens: neither spelling
            with pytest.raises(SystemExit):
                parser.parse_args(argv_of(levels, (action, mixed)))
            capsys.readouterr()


def test_evaluate_takes_max_new_tokens_as_generate_does():
    from valen_jax import evaluate, generate
    base = ["--workdir=w", "--data=d", "--output=o"]
    for cli in (evaluate, generate):
        for spelling in ("--max-new-tokens=5", "--max_new_tokens=5"):
            assert cli.build_parser().parse_args([*base, spelling]).max_new_tokens == 5
    args = evaluate.build_parser().parse_args([*base, "--max_examples=2", "--batch-size=3", "--from_call"])
    assert (args.max_examples, args.batch_size, args.from_call) == (2, 3, True)


def toy() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="toy")
    add_flag(parser, "--max-new-tokens", type=int, default=None, help="budget")
    add_flag(parser, "--output-dir", required=True)
    add_flag(parser, "--from-call", action="store_true")
    add_flag(parser, "--seed", type=int, default=0)  # one word: no alias, a plain add_argument
    return parser


def test_add_flag_names_the_hyphenated_spelling_in_help_usage_and_errors(capsys):
    parser = toy()
    assert parser.parse_args(["--output_dir=o", "--max_new_tokens=4", "--from_call"]) == \
        parser.parse_args(["--output-dir=o", "--max-new-tokens=4", "--from-call"]) == \
        argparse.Namespace(max_new_tokens=4, output_dir="o", from_call=True, seed=0)
    text = parser.format_help()
    assert "--max-new-tokens MAX_NEW_TOKENS" in text and "--from-call" in text
    assert not UNDERSCORED.findall(text)
    with pytest.raises(SystemExit):
        parser.parse_args(["--max_new_tokens=many", "--output-dir=o"])
    assert "argument --max-new-tokens: invalid int value: 'many'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args([])
    assert "the following arguments are required: --output-dir" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["--output-dir=o", "--seed_=1"])
    assert "unrecognized arguments: --seed_=1" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--max_new_tokens", "-m", "max-new-tokens", "--max-new_tokens"])
def test_add_flag_wants_the_hyphenated_long_spelling(flag):
    with pytest.raises(ValueError, match="hyphenated long spelling"):
        add_flag(argparse.ArgumentParser(), flag)


def test_add_flag_works_on_subcommands_and_argument_groups():
    parser = argparse.ArgumentParser(prog="toy")
    add_flag(parser.add_argument_group("limits"), "--upload-limit-mib", type=float)
    register = parser.add_subparsers(dest="command", required=True).add_parser("register")
    add_flag(register, "--no-upload", action="store_true")
    assert parser.parse_args(["--upload_limit_mib=2", "register", "--no_upload"]) == \
        argparse.Namespace(upload_limit_mib=2.0, command="register", no_upload=True)

"""Split a dataset into leak-free parts, deterministically for a seed (seeds 000, 002, 003; issue 17).

    python -m data_pipeline.split --format=valen --input=data/smoke/valen/train.jsonl \\
        --output-dir=/tmp/valen_split --fractions=train=0.7,eval=0.3 --seed=1 --prefix=split.
    python -m data_pipeline.split --format=vakforge --input=data/smoke/vakforge/vakforge.jsonl \\
        --output-dir=/tmp/vk --fractions=train=0.6,dev=0.2,test=0.2 --seed=20260916

What stays together (one group never spans two splits):
- valen: records of one `group_id` (seed 000: "the same source material and its variants share one
  group ID"), and records sharing a media file;
- vakforge: a conversation, and every conversation of a speaker (`meta.speakers.agent`/`.user`, one
  namespace; seed 002: "no speaker ... appears in more than one split"); a conversation stating
  `meta.split` keeps it, its speaker group with it. This is `python -m data_pipeline.vakforge split`
  (data_pipeline/vakforge/split.py), which writes `splits.json` (the seed and the conversation ids per
  split), checked by the vakforge reader; the manifest is not copied (its audio paths are relative to
  its folder), so put splits.json next to it;
- chat, vflash: each row, joined with every row naming the same image or video by content
  (SHA-256 of the file; union-find over rows sharing one), so no image lands in two splits.

The input is validated by its format first (without decoding media). Groups are ordered by their
smallest line, shuffled with numpy's PCG64 seeded by `--seed`, and dealt out so each split's row
count tracks its fraction. Rows keep their input order and bytes within a split. Rows written to
`OUTPUT_DIR/PREFIX+SPLIT.jsonl`; relative media paths resolve against the input's folder, so any
other output folder is refused for data that names media by relative path. Prepared rows and
recipes are refused: split the annotation files (`--format=vflash`) or the rows before preparing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from data_pipeline.cli_flags import add_flag
from data_pipeline.format_registry import FORMATS
from data_pipeline.formats.errors import FormatError
from data_pipeline.split_groups import SplitError, assign, group_rows, parse_fractions
from data_pipeline.vakforge.split import split_manifest

__all__ = ["SPLITTABLE", "SplitError", "assign", "group_rows", "main", "parse_fractions", "split"]

SPLITTABLE = ("valen", "vakforge", "chat", "vflash")

def _read_lines(path: Path) -> list[tuple[int, str, dict]]:
    """(1-based line, raw text, record) of each non-blank line; the format's validator ran before."""
    rows = []
    with path.open(encoding="utf-8") as f:
        for number, text in enumerate(f, 1):
            if text.strip():
                rows.append((number, text if text.endswith("\n") else text + "\n", json.loads(text)))
    return rows


def split(fmt: str, input_path: Path, output_dir: Path, fractions: dict[str, float], seed: int,
          prefix: str = "") -> dict:
    """Write the splits; returns what was done (per split: rows, groups; the files written)."""
    if "/" in prefix or "\\" in prefix:
        raise SplitError(f"--prefix={prefix!r}: a file name prefix, without '/'")
    if fmt not in SPLITTABLE:
        raise SplitError(f"--format={fmt}: splitting takes {', '.join(SPLITTABLE)} (a recipe: split its "
                         "annotation files with --format=vflash; prepared rows: split before preparing)")
    if not input_path.is_file():
        raise SplitError(f"--input={input_path}: no such file")
    if fmt == "vakforge":
        # One vakforge split (issue 27): `vakforge split`'s, which keeps a conversation's stated meta.split
        # (and its speaker group with it) where the reader requires splits.json to agree with it.
        return _vakforge(input_path, output_dir, fractions, seed)
    FORMATS[fmt].validate(input_path, check_media=False)
    rows = _read_lines(input_path)
    groups, relative = group_rows(fmt, input_path, rows)
    sizes = [0] * (max(groups) + 1 if groups else 0)
    for g in groups:
        sizes[g] += 1
    if len(sizes) < len(fractions):
        raise SplitError(f"{input_path}: {len(sizes)} groups cannot fill {len(fractions)} splits "
                         f"({', '.join(fractions)})")
    chosen = assign(sizes, fractions, seed)
    empty = [name for name in fractions if name not in chosen]
    if empty:
        raise SplitError(f"{input_path}: splits {', '.join(empty)} got no group ({len(sizes)} groups, sizes "
                         f"{sorted(sizes, reverse=True)[:5]}…); change --fractions or --seed")
    summary = {"input": str(input_path), "format": fmt, "seed": seed, "rows": len(rows), "groups": len(sizes),
               "splits": {name: {"rows": 0, "groups": chosen.count(name)} for name in fractions}, "files": []}
    for g in groups:
        summary["splits"][chosen[g]]["rows"] += 1
    if relative and output_dir.resolve() != input_path.parent.resolve():
        raise SplitError(f"{input_path}: {relative} rows name media relative to {input_path.parent}; write the "
                         f"splits there (--output-dir={input_path.parent}, with --prefix to keep names apart)")
    targets = {name: output_dir / f"{prefix}{name}.jsonl" for name in fractions}
    for target in targets.values():
        if target.resolve() == input_path.resolve():
            raise SplitError(f"{target}: would overwrite --input; choose another --output-dir or --prefix")
    output_dir.mkdir(parents=True, exist_ok=True)  # after every check: a refused split leaves no folder
    for name, target in targets.items():
        target.write_text("".join(text for i, (_, text, _) in enumerate(rows) if chosen[groups[i]] == name),
                          encoding="utf-8")
        summary["files"].append(str(target))
    return summary


def _vakforge(manifest: Path, output_dir: Path, fractions: dict[str, float], seed: int) -> dict:
    """`vakforge split` of `manifest` into OUTPUT_DIR/splits.json, summarised as `split` summarises."""
    done = split_manifest(manifest, fractions, seed, output_dir)
    return {"input": done["manifest"], "format": "vakforge", "seed": seed, "rows": done["conversations"],
            "groups": done["groups"], "files": [done["file"]],
            "splits": {name: {"rows": counts["conversations"], "groups": counts["groups"]}
                       for name, counts in done["splits"].items()}}


def build_parser() -> argparse.ArgumentParser:
    """The command line of `main`: multi-word flags through `cli_flags.add_flag` (hyphens, or underscores)."""
    parser = argparse.ArgumentParser(prog="python -m data_pipeline.split", description=__doc__.splitlines()[0])
    parser.add_argument("--format", required=True, choices=sorted(FORMATS))
    parser.add_argument("--input", required=True, type=Path)
    add_flag(parser, "--output-dir", required=True, type=Path)
    parser.add_argument("--fractions", required=True, help="NAME=FRACTION,… summing to 1, e.g. train=0.8,eval=0.2")
    parser.add_argument("--seed", required=True, type=int)
    parser.add_argument("--prefix", default="", help="file name prefix: OUTPUT_DIR/PREFIX+SPLIT.jsonl")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        summary = split(args.format, args.input, args.output_dir, parse_fractions(args.fractions), args.seed,
                        args.prefix)
    except (SplitError, FormatError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    unit = {"valen": "group_id/media groups", "vakforge": "conversation/speaker groups"}.get(args.format,
                                                                                           "row/media groups")
    print(f"{summary['input']}: {summary['rows']} rows in {summary['groups']} {unit}, seed {summary['seed']}")
    for name, counts in summary["splits"].items():
        print(f"  {name}: {counts['rows']} rows, {counts['groups']} groups")
    for path in summary["files"]:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

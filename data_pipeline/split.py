"""Split a dataset into leak-free parts, deterministically for a seed (seeds 000, 002, 003; issue 17).

    python -m data_pipeline.split --format=valen --input=data/smoke/valen/train.jsonl \\
        --output-dir=/tmp/valen_split --fractions=train=0.7,eval=0.3 --seed=1 --prefix=split.
    python -m data_pipeline.split --format=vakforge --input=data/smoke/vakforge/vakforge.jsonl \\
        --output-dir=/tmp/vk --fractions=train=0.6,dev=0.2,test=0.2 --seed=20260916

What stays together (one group never spans two splits):
- valen: records of one `group_id` (seed 000: "the same source material and its variants share one
  group ID"), and records sharing a media file;
- vakforge: a conversation, and every conversation of a speaker (`meta.speakers.agent`/`.user`, one
  namespace; seed 002: "no speaker ... appears in more than one split"); writes `splits.json` (the
  seed and the conversation ids per split), which the vakforge reader then checks; the manifest is
  not copied (its audio paths are relative to its folder), so put splits.json next to it;
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
import hashlib
import json
import math
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np

from data_pipeline.cli_flags import add_flag
from data_pipeline.format_registry import FORMATS
from data_pipeline.formats.errors import FormatError

SPLITTABLE = ("valen", "vakforge", "chat", "vflash")
# JSON keys whose string values name a media file (vflash `image`/`video`, chat parts' `path` of an
# `image`/`video` part, Valen `image_url`/`video_url` `url`).
_MEDIA_KEYS = ("image", "images", "video", "videos")


class SplitError(ValueError):
    """Bad arguments or data the split cannot honour; the message names the flag or file:line."""


def parse_fractions(text: str) -> dict[str, float]:
    """`train=0.8,eval=0.2` → {"train": 0.8, "eval": 0.2}: distinct names, each in (0, 1], summing to 1."""
    fractions: dict[str, float] = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or not name:
            raise SplitError(f"--fractions={text!r}: {part!r} is not NAME=FRACTION")
        if not name.replace("_", "").replace("-", "").isalnum():
            raise SplitError(f"--fractions: split name {name!r} must be letters, digits, '_' or '-'")
        if name in fractions:
            raise SplitError(f"--fractions: split {name!r} is named twice")
        try:
            fraction = float(value)
        except ValueError:
            raise SplitError(f"--fractions: {name}={value!r} is not a number") from None
        if not (math.isfinite(fraction) and 0 < fraction <= 1):
            raise SplitError(f"--fractions: {name}={value} must be in (0, 1]")
        fractions[name] = fraction
    if abs(sum(fractions.values()) - 1) > 1e-6:
        raise SplitError(f"--fractions={text!r} sums to {sum(fractions.values()):.6g}, not 1")
    return fractions


class _UnionFind:
    def __init__(self, size: int):
        self.parent = list(range(size))

    def find(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def union(self, a: int, b: int) -> None:
        a, b = self.find(a), self.find(b)
        if a != b:
            self.parent[max(a, b)] = min(a, b)  # the smaller line leads: groups keep their first line


def _media_paths(value, out: list[str], key: str | None = None) -> None:
    """Every string naming a media file in a record, however nested. An LMDB item is written
    `lmdb:FILE#KEY` (its own content is one entry of a shared file, not the whole file)."""
    if isinstance(value, dict):
        if key in _MEDIA_KEYS:  # a VFlash media object: {file|video: PATH, …} or {lmdb_file, lmdb_key}
            for field in ("file", "video"):
                if isinstance(value.get(field), str):
                    out.append(value[field])
            if isinstance(value.get("lmdb_file"), str):
                out.append(f"lmdb:{value['lmdb_file']}#{value.get('lmdb_key')}")
            return
        kind = value.get("type")
        for k, v in value.items():
            if k == "path" and kind in ("image", "video") and isinstance(v, str):
                out.append(v)
            elif k == "url" and key in ("image_url", "video_url") and isinstance(v, str):
                out.append(v)
            else:
                _media_paths(v, out, k)
    elif isinstance(value, list):
        for v in value:
            _media_paths(v, out, key)
    elif isinstance(value, str) and key in _MEDIA_KEYS:
        out.append(value)


def _media_digest(folder: Path, name: str, where: str, cache: dict[Path, str]) -> str:
    path = Path(name) if Path(name).is_absolute() else folder / name
    if path not in cache:
        try:
            cache[path] = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError as error:
            raise SplitError(f"{where}: media {name!r}: {error.strerror or error}") from None
    return cache[path]


def _read_lines(path: Path) -> list[tuple[int, str, dict]]:
    """(1-based line, raw text, record) of each non-blank line; the format's validator ran before."""
    rows = []
    with path.open(encoding="utf-8") as f:
        for number, text in enumerate(f, 1):
            if text.strip():
                rows.append((number, text if text.endswith("\n") else text + "\n", json.loads(text)))
    return rows


def group_rows(fmt: str, path: Path, rows: list[tuple[int, str, dict]]) -> tuple[list[int], int]:
    """(group index of each row, rows that name media by relative path). Rows sharing a group key
    (Valen group_id, vakforge speaker) or a media file's content are one group."""
    uf = _UnionFind(len(rows))
    first_of: dict[str, int] = {}
    digests: dict[Path, str] = {}
    relative = 0

    def join(key: str, i: int) -> None:
        if key in first_of:
            uf.union(first_of[key], i)
        else:
            first_of[key] = i

    for i, (number, _, record) in enumerate(rows):
        where = f"{path}:{number}"
        if fmt == "valen":
            join(f"group:{record['group_id']}", i)
        if fmt == "vakforge":
            join(f"conversation:{record['id']}", i)
            speakers = (record.get("meta") or {}).get("speakers") or {}
            for role in ("agent", "user"):
                if speakers.get(role):  # one namespace: a person is the same in either role
                    join(f"speaker:{speakers[role]}", i)
            continue  # audio is per conversation; the conversation is the unit already
        names: list[str] = []
        _media_paths(record, names)
        relative += any(not Path(n).is_absolute() for n in names)
        for name in names:
            join(name if name.startswith("lmdb:") else f"media:{_media_digest(path.parent, name, where, digests)}", i)
    roots = [uf.find(i) for i in range(len(rows))]
    index = {root: k for k, root in enumerate(dict.fromkeys(roots))}
    return [index[r] for r in roots], relative


def assign(group_sizes: list[int], fractions: dict[str, float], seed: int,
           fixed: dict[int, str] | None = None) -> list[str]:
    """The split of each group: groups in a seeded random order, each given to the split furthest below
    its share of the rows dealt so far (ties: the order of --fractions). `fixed` groups (index -> split)
    keep their split and count first, so the others fill around them."""
    fixed = fixed or {}
    order = np.random.default_rng(seed).permutation(len(group_sizes))
    names = list(fractions)
    counts = dict.fromkeys(names, 0)
    chosen = [""] * len(group_sizes)
    dealt = 0
    for g, name in fixed.items():
        chosen[g] = name
        counts[name] += group_sizes[g]
        dealt += group_sizes[g]
    for g in (g for g in order if g not in fixed):
        size = group_sizes[g]
        after = dealt + size
        name = max(names, key=lambda n: (fractions[n] * after - counts[n], -names.index(n)))
        chosen[g] = name
        counts[name] += size
        dealt = after
    return chosen


def _validate(fmt: str, path: Path) -> None:
    spec = FORMATS[fmt]
    if fmt != "vakforge":
        spec.validate(path, check_media=False)
        return
    # Vakforge's reader checks a splits.json; the one this split replaces is not read: all in one split.
    from data_pipeline.formats.vakforge import read_vakforge
    # (A conversation's own meta.split, when it states one, must agree: that split holds it here.)
    provisional: dict[str, list[str]] = defaultdict(list)
    for line in path.read_text(encoding="utf-8").splitlines():
        record = json.loads(line) if line.strip() else None
        if isinstance(record, dict) and isinstance(record.get("id"), str):
            stated = (record.get("meta") or {}).get("split") if isinstance(record.get("meta"), dict) else None
            provisional[stated if isinstance(stated, str) else "all"].append(record["id"])
    with tempfile.TemporaryDirectory() as tmp:
        splits = Path(tmp) / "splits.json"
        splits.write_text(json.dumps({"seed": 0, "splits": provisional}))
        read_vakforge(path, check_media=False, splits_path=splits)


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
    _validate(fmt, input_path)
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
    output_dir.mkdir(parents=True, exist_ok=True)
    summary = {"input": str(input_path), "format": fmt, "seed": seed, "rows": len(rows), "groups": len(sizes),
               "splits": {name: {"rows": 0, "groups": chosen.count(name)} for name in fractions}, "files": []}
    for g in groups:
        summary["splits"][chosen[g]]["rows"] += 1
    if fmt == "vakforge":
        ids = {name: [rows[i][2]["id"] for i in range(len(rows)) if chosen[groups[i]] == name] for name in fractions}
        target = output_dir / "splits.json"
        written = target.with_name(target.name + ".tmp")
        written.write_text(json.dumps({"seed": seed, "splits": ids}, indent=2) + "\n", encoding="utf-8")
        try:  # the reader's own check (speaker leaks, meta.split agreement) before the file is in place
            from data_pipeline.formats.vakforge import read_vakforge
            read_vakforge(input_path, check_media=False, splits_path=written)
        except FormatError:
            written.unlink()
            raise
        written.replace(target)
        summary["files"].append(str(target))
        return summary
    if relative and output_dir.resolve() != input_path.parent.resolve():
        raise SplitError(f"{input_path}: {relative} rows name media relative to {input_path.parent}; write the "
                         f"splits there (--output-dir={input_path.parent}, with --prefix to keep names apart)")
    targets = {name: output_dir / f"{prefix}{name}.jsonl" for name in fractions}
    for target in targets.values():
        if target.resolve() == input_path.resolve():
            raise SplitError(f"{target}: would overwrite --input; choose another --output-dir or --prefix")
    for name, target in targets.items():
        target.write_text("".join(text for i, (_, text, _) in enumerate(rows) if chosen[groups[i]] == name),
                          encoding="utf-8")
        summary["files"].append(str(target))
    return summary


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

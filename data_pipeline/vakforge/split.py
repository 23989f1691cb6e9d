"""`vakforge split`: speaker-disjoint splits of a vakforge manifest into splits.json (seed 002, "Splits").

    python -m data_pipeline.vakforge split --manifest=data/smoke/vakforge/vakforge.jsonl --seed=20260916 \\
        --fractions=train=0.6,dev=0.2,test=0.2 --output-dir=/tmp/vk_split

Writes `splits.json` ({"seed": S, "splits": {name: [conversation ids]}}), by default next to the
manifest, where `vakforge validate` reads it (replacing the one there, which it says). The grouping
and the seeded dealing are data_pipeline.split's: a conversation and every conversation sharing a
speaker (`meta.speakers.agent`/`.user`, one namespace) form one group, groups are shuffled by
`--seed` and dealt so each split's conversation count tracks its fraction.

What this adds to `python -m data_pipeline.split --format=vakforge`:
- a conversation that states `meta.split` keeps it (the reader requires meta.split and splits.json to
  agree), and its whole speaker group goes with it; conversations sharing a speaker that state two
  splits already leak, and the reader's leak check names them; a stated split missing from
  --fractions is an error too;
- conversations naming no speaker are counted and reported: each is its own group, so nothing
  keeps an unnamed speaker in one split;
- the written file is checked by the reader (vakforge_splits.check_splits through read_vakforge,
  media not decoded) before it replaces anything.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from data_pipeline.cli_flags import add_flag
from data_pipeline.formats.errors import FormatError
from data_pipeline.formats.vakforge import read_vakforge
from data_pipeline.formats.vakforge_splits import SPLITS_FILE
from data_pipeline.split_groups import SplitError, assign, group_rows, parse_fractions

DEFAULT_FRACTIONS = "train=0.8,dev=0.1,test=0.1"
_UNSTATED = "unassigned"  # the provisional split of groups stating none, while the manifest is validated

# (line, raw text, {"id", "meta": {"split", "speakers"}}) of a conversation: what grouping reads.
Row = tuple[int, str, dict]


def split_manifest(manifest: Path, fractions: dict[str, float], seed: int, output_dir: Path | None = None) -> dict:
    """Write splits.json for `manifest`; returns what was done (per split: conversations, groups)."""
    if not manifest.is_file():
        raise SplitError(f"--manifest={manifest}: no such file")
    rows = _conversations(manifest)
    groups, _ = group_rows("vakforge", manifest, rows)
    fixed = _stated_splits(rows, groups)
    _validate(manifest, rows, groups, fixed)
    for line, _, record in rows:
        name = record["meta"]["split"]
        if name is not None and name not in fractions:
            raise SplitError(f"{manifest}:{line}: id={record['id']}: meta.split: {name!r} is not one of --fractions "
                             f"({', '.join(fractions)}); add it or drop meta.split")
    sizes = [0] * (max(groups) + 1 if groups else 0)
    for g in groups:
        sizes[g] += 1
    if len(sizes) < len(fractions):
        raise SplitError(f"{manifest}: {len(sizes)} speaker groups cannot fill {len(fractions)} splits "
                         f"({', '.join(fractions)})")
    chosen = assign(sizes, fractions, seed, fixed)
    empty = [name for name in fractions if name not in chosen]
    if empty:
        raise SplitError(f"{manifest}: splits {', '.join(empty)} got no speaker group ({len(sizes)} groups, "
                         f"{len(fixed)} fixed by meta.split); change --fractions or --seed")
    ids = {name: [rows[i][2]["id"] for i in range(len(rows)) if chosen[groups[i]] == name] for name in fractions}
    target = (output_dir or manifest.parent) / SPLITS_FILE
    replaced = target.exists()
    with tempfile.TemporaryDirectory() as tmp:
        # Checked in a temporary folder first (a refusal names no file the user cannot see or edit, and
        # leaves no output folder), then copied beside the final name and renamed into place.
        checked = Path(tmp) / SPLITS_FILE
        # One id per line, as the smoke set's splits.json: reviewable diffs, and the reader names lines.
        checked.write_text(json.dumps({"seed": seed, "splits": ids}, indent=2) + "\n", encoding="utf-8")
        # The reader's own check: complete, one split per conversation, no speaker leak, meta.split agrees.
        read_vakforge(manifest, check_media=False, splits_path=checked)
        target.parent.mkdir(parents=True, exist_ok=True)
        written = target.with_name(target.name + ".tmp")
        written.write_bytes(checked.read_bytes())
        written.replace(target)
    unnamed = sum(1 for _, _, r in rows if not r["meta"]["speakers"])
    return {
        "manifest": str(manifest), "seed": seed, "conversations": len(rows), "groups": len(sizes),
        "fixed_groups": len(fixed), "without_speakers": unnamed, "file": str(target), "replaced": replaced,
        "splits": {name: {"conversations": len(ids[name]), "groups": chosen.count(name)} for name in fractions},
    }


def _conversations(manifest: Path) -> list[Row]:
    """Every line that is an object with a string id, reduced to what grouping reads. Tolerant, because
    it runs before validation: the reader reports every other line's problems with their fix."""
    rows = []
    with manifest.open(encoding="utf-8", errors="replace") as f:
        for number, text in enumerate(f, 1):
            try:
                record = json.loads(text)
            except ValueError:
                continue
            if not isinstance(record, dict) or not isinstance(record.get("id"), str):
                continue
            record_meta = record.get("meta") if isinstance(record.get("meta"), dict) else {}
            speakers = record_meta.get("speakers") if isinstance(record_meta.get("speakers"), dict) else {}
            split = record_meta.get("split") if isinstance(record_meta.get("split"), str) else None
            speakers = {role: speakers[role] for role in ("agent", "user") if isinstance(speakers.get(role), str)}
            rows.append((number, text, {"id": record["id"], "meta": {"split": split, "speakers": speakers}}))
    return rows


def _stated_splits(rows: list[Row], groups: list[int]) -> dict[int, str]:
    """group -> the first split one of its conversations states in meta.split."""
    fixed: dict[int, str] = {}
    for (_, _, record), g in zip(rows, groups, strict=True):
        if record["meta"]["split"] is not None:
            fixed.setdefault(g, record["meta"]["split"])
    return fixed


def _validate(manifest: Path, rows: list[Row], groups: list[int], fixed: dict[int, str]) -> None:
    """The manifest through the reader, media not decoded, against a provisional splits.json that puts
    each group where it must go: a conversation's stated split, else its group's, else `unassigned`.
    So the reader reports every problem of the data, and a speaker leak only where meta.split values
    themselves put one speaker in two splits (two conversations sharing a speaker, stating two splits)."""
    provisional: dict[str, list[str]] = {}
    for (_, _, record), g in zip(rows, groups, strict=True):
        provisional.setdefault(record["meta"]["split"] or fixed.get(g, _UNSTATED), []).append(record["id"])
    with tempfile.TemporaryDirectory() as tmp:
        splits = Path(tmp) / SPLITS_FILE
        splits.write_text(json.dumps({"seed": 0, "splits": provisional}), encoding="utf-8")
        read_vakforge(manifest, check_media=False, splits_path=splits)


def build_parser() -> argparse.ArgumentParser:
    """The command line of `main`: multi-word flags through `cli_flags.add_flag` (hyphens, or underscores)."""
    parser = argparse.ArgumentParser(prog="python -m data_pipeline.vakforge split", description=__doc__.splitlines()[0])
    parser.add_argument("--manifest", required=True, type=Path, help="the vakforge.jsonl to split")
    parser.add_argument("--seed", required=True, type=int, help="recorded in splits.json")
    parser.add_argument("--fractions", default=DEFAULT_FRACTIONS,
                        help=f"NAME=FRACTION,… summing to 1 (default {DEFAULT_FRACTIONS})")
    add_flag(parser, "--output-dir", type=Path, help="where splits.json goes (default: the manifest's folder)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        summary = split_manifest(args.manifest, parse_fractions(args.fractions), args.seed, args.output_dir)
    except (SplitError, FormatError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"{summary['manifest']}: {summary['conversations']} conversations in {summary['groups']} speaker groups "
          f"({summary['fixed_groups']} fixed by meta.split), seed {summary['seed']}")
    for name, counts in summary["splits"].items():
        print(f"  {name}: {counts['conversations']} conversations, {counts['groups']} groups")
    if summary["without_speakers"]:
        print(f"note: {summary['without_speakers']} conversations name no speaker (meta.speakers); each is its own "
              "group, so their speakers are not kept to one split")
    print(f"{'replaced' if summary['replaced'] else 'wrote'} {summary['file']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

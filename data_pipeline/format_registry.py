"""The one table of input formats: what validate, conversion (local and Beam) and evaluation know of each.

Per format: how `validate` checks a file (a one-line summary, or a FormatError), how conversion
loads it into entries of records and renders one record, the options each step takes (with their
defaults), the Example kind its shards hold (`data_pipeline.examples`) and its family (the records
it holds: a recipe holds VFlash records; evaluation reports by family). Adding a format touches
this table and the format's own modules (its reader in `formats/`, its renderer in `render/`).
It sits above both packages, so the flow stays one way: formats and render never import it.

    from data_pipeline.format_registry import FORMATS
    FORMATS["recipe"].validate(Path("data/smoke/vflash/recipe.json"), check_media=True)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from data_pipeline import examples
from data_pipeline.formats.chat import chat_diagnostics, read_chat
from data_pipeline.formats.prepared import read_prepared
from data_pipeline.formats.prepared_load import check_prepared, read_prepared_rows
from data_pipeline.formats.recipe import read_recipe_records
from data_pipeline.formats.vakforge import export_schema, read_vakforge
from data_pipeline.formats.vakforge_items import read_vakforge_items
from data_pipeline.formats.valen import check_valen, read_valen
from data_pipeline.formats.vflash import read_vflash
from data_pipeline.render.chat import ASSISTANT_TURNS, ChatRenderer
from data_pipeline.render.prepared import PreparedRenderer
from data_pipeline.render.vakforge import OVERLAP_POLICIES, VakforgeRenderer
from data_pipeline.render.valen import ValenRenderer
from data_pipeline.render.vflash import VFlashRenderer


@dataclass(frozen=True)
class SourceEntry:
    """One named group of records (a recipe entry, or a whole file), kept in input order."""

    name: str
    files: tuple[Path, ...]
    repeat_time: float
    records: list
    # What the loader needs to treat this entry's media (recipe `data_augment`, `visual_aug`,
    # `video_reader_backend`, seed 004); written into the manifest's entry when non-empty.
    media_options: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class Format:
    """One input format.

    `validate(path, check_media, **validate_options) -> str` returns a one-line summary or raises
    FormatError. `load(path, **load_options)` runs once in the converting process and returns the
    entries. `make_renderer(tokenizer, **render_options)` returns an object with
    `render(record, entry_name) -> Example`; it runs in worker processes, so it must be a picklable
    module-level callable. Each options mapping names the options the step takes, with defaults;
    a conversion option is declared once in CONVERT_OPTIONS (its command-line flag).

    `check(input_path, entries, tokenizer_path, **load_options)`, when given, runs in the
    converting process after loading and before rendering, and returns additions to manifest.json.
    It exists for checks that need the tokenizer path rather than the training tokenizer (prepared
    rows are compared with the tokenizer as shipped, seed 003) and for provenance only the loader
    knows (vakforge's manifest_hash, seed 002 "Adapters").

    `schema`: (default file name, exporter) of a format whose records have a JSON Schema.
    """

    kind: str  # the Example kind of its shards: one of examples.KINDS
    family: str  # the records it holds; evaluation reports by family
    validate: Callable[..., str]
    load: Callable[..., list[SourceEntry]]
    make_renderer: Callable[..., object]
    load_options: Mapping[str, object] = field(default_factory=dict)
    render_options: Mapping[str, object] = field(default_factory=dict)
    validate_options: Mapping[str, object] = field(default_factory=dict)
    check: Callable[..., dict] | None = None
    schema: tuple[str, Callable[[Path], Path]] | None = None

    def __post_init__(self):
        if self.kind not in examples.KINDS:
            raise ValueError(f"kind={self.kind!r}: choose one of {', '.join(examples.KINDS)}")


# --- validate: one summary line per file ---

def _validate_valen(path: Path, check_media: bool, allow_absolute_media: bool = False) -> str:
    # The streaming pass: builds no records, so memory stays flat however long the file is.
    return f"{check_valen(path, check_media=check_media, allow_absolute_media=allow_absolute_media)} OK"


def _validate_vflash(path: Path, check_media: bool, allow_absolute_media: bool = False) -> str:
    return f"{len(read_vflash(path, check_media=check_media, allow_absolute_media=allow_absolute_media))} records OK"


def _validate_recipe(path: Path, check_media: bool, allow_absolute_media: bool = False) -> str:
    entries = read_recipe_records(path, check_media=check_media, allow_absolute_media=allow_absolute_media)
    records = sum(len(records) for _, records in entries)
    return f"{len(entries)} entries, {records} records OK"


def _validate_chat(path: Path, check_media: bool, allow_absolute_media: bool = False) -> str:
    records = read_chat(path, check_media=check_media, allow_absolute_media=allow_absolute_media)
    # Seed 003: diagnostics, not findings; they never fail a file.
    return f"{len(records)} records OK; {chat_diagnostics(records).summary()}"


def _validate_prepared(path: Path, check_media: bool) -> str:
    # PATH is a prepared zip, or a directory laid out like one; there is no media to check.
    stats = read_prepared(path).stats
    rows, tokens = sum(s.rows for s in stats), sum(s.tokens for s in stats)
    supervised, longest = sum(s.supervised_tokens for s in stats), max(s.longest_row for s in stats)
    return f"{len(stats)} files, {rows} rows, {tokens} tokens, {supervised} supervised, longest row {longest} OK"


def _validate_vakforge(path: Path, check_media: bool, allow_unconsented: bool = False) -> str:
    records = read_vakforge(path, allow_unconsented=allow_unconsented, check_media=check_media)
    return f"{len(records)} conversations OK"


# --- conversion: input → entries of records ---

def _load_vflash(path: Path, dense_scale: float | None, allow_absolute_media: bool) -> list[SourceEntry]:
    # A plain file has no recipe entry to state its dense-motion scale s (seed 004): an option does.
    records = read_vflash(path, dense_scale=dense_scale, allow_absolute_media=allow_absolute_media)
    return [SourceEntry(path.stem, (path,), 1.0, records)]


def _load_recipe(path: Path, allow_absolute_media: bool) -> list[SourceEntry]:
    return [SourceEntry(entry.name, tuple(entry.annotation), entry.repeat_time, records, _media_options(entry))
            for entry, records in read_recipe_records(path, allow_absolute_media=allow_absolute_media)]


def _media_options(entry) -> dict:
    aug = entry.visual_aug
    options = {"data_augment": entry.data_augment, "video_reader_backend": entry.video_reader_backend}
    if aug is not None:
        options["visual_aug"] = {"prob": aug.prob, "views": aug.views if isinstance(aug.views, str) else list(aug.views),
                                 "ops": list(aug.ops), "severity": list(aug.severity),
                                 "zoom_max_severity": aug.zoom_max_severity}
    return options


def _load_valen(path: Path, allow_absolute_media: bool) -> list[SourceEntry]:
    return [SourceEntry(path.stem, (path,), 1.0, read_valen(path, allow_absolute_media=allow_absolute_media))]


def _load_chat(path: Path, allow_absolute_media: bool) -> list[SourceEntry]:
    return [SourceEntry(path.stem, (path,), 1.0, read_chat(path, allow_absolute_media=allow_absolute_media))]


def _load_prepared(path: Path, max_seq_length: int | None) -> list[SourceEntry]:
    _, rows = read_prepared_rows(path)
    files = (path,) if path.is_file() else tuple(sorted(p for p in path.rglob("*") if p.is_file()))
    return [SourceEntry(path.stem, files, 1.0, rows)]


def _check_prepared(path: Path, entries: list[SourceEntry], tokenizer_path: str,
                    max_seq_length: int | None) -> dict:
    return check_prepared(path, entries[0].records, tokenizer_path, max_seq_length)


def _load_vakforge(path: Path, split: str | None) -> list[SourceEntry]:
    items = read_vakforge_items(path, split)
    return [SourceEntry(path.stem if split is None else split, (path, path.parent / "splits.json"), 1.0, items)]


def _check_vakforge(path: Path, entries: list[SourceEntry], tokenizer_path: str, split: str | None) -> dict:
    # Seed 002, "Adapters": the output names the exact data it came from (one hash per manifest).
    return {"manifest_hash": entries[0].records[0].manifest_hash}


# Media paths must stay inside the dataset folder unless the user allows more (issue 19; media_paths).
_MEDIA = {"allow_absolute_media": False}

FORMATS: dict[str, Format] = {
    "valen": Format(examples.VALEN, "valen", _validate_valen, _load_valen, ValenRenderer, load_options=_MEDIA,
                    validate_options=_MEDIA),
    "vflash": Format(examples.TOKENS, "vflash", _validate_vflash, _load_vflash, VFlashRenderer,
                     load_options={"dense_scale": None, **_MEDIA}, validate_options=_MEDIA),
    "recipe": Format(examples.TOKENS, "vflash", _validate_recipe, _load_recipe, VFlashRenderer, load_options=_MEDIA,
                     validate_options=_MEDIA),
    "chat": Format(examples.TOKENS, "chat", _validate_chat, _load_chat, ChatRenderer, load_options=_MEDIA,
                   render_options={"assistant_turns": "all"}, validate_options=_MEDIA),
    "vakforge": Format(examples.TOKENS, "vakforge", _validate_vakforge, _load_vakforge, VakforgeRenderer,
                       load_options={"split": None}, render_options={"overlap": "merge", "assistant_turns": "all"},
                       validate_options={"allow_unconsented": False}, check=_check_vakforge,
                       schema=("vakforge.schema.json", export_schema)),
    "prepared": Format(examples.TOKENS, "prepared", _validate_prepared, _load_prepared, PreparedRenderer,
                       load_options={"max_seq_length": None}, check=_check_prepared),
}


def get(name: str) -> Format:
    """The format called `name`; an unknown name is an error that lists the known ones."""
    if name not in FORMATS:
        raise ValueError(f"format {name!r}: choose one of {', '.join(FORMATS)}")
    return FORMATS[name]


@dataclass(frozen=True)
class ConvertOption:
    """A conversion option some formats take; `python -m data_pipeline.convert` offers it as
    `--NAME-WITH-DASHES`, and a format that does not take it refuses it."""

    type: Callable[[str], object] | None  # None: a flag without a value, which sets True
    meaning: str
    choices: tuple[str, ...] | None = None


# Every option of any format's load_options/render_options, declared once for the command line.
CONVERT_OPTIONS: dict[str, ConvertOption] = {
    "assistant_turns": ConvertOption(str, "loss policy", ASSISTANT_TURNS),
    "split": ConvertOption(str, "convert only this split of splits.json"),
    "overlap": ConvertOption(str, "overlapping turns", OVERLAP_POLICIES),
    "max_seq_length": ConvertOption(int, "refuse rows longer than this"),
    "dense_scale": ConvertOption(float, "the file's dense-motion scale s in metres (a recipe states it per entry)"),
    "allow_absolute_media": ConvertOption(None, "read media at absolute local paths and outside the dataset "
                                                "folder (seed 000: absolute paths work); off: refused"),
}


def takers(option: str) -> dict[str, object]:
    """Format name -> its default for `option`, for the formats that take it."""
    return {name: {**spec.load_options, **spec.render_options}[option] for name, spec in FORMATS.items()
            if option in spec.load_options or option in spec.render_options}


def undeclared_options() -> list[str]:
    """Options some format takes that CONVERT_OPTIONS does not declare (tests keep this empty)."""
    return sorted({o for spec in FORMATS.values() for o in (*spec.load_options, *spec.render_options)}
                  - set(CONVERT_OPTIONS))

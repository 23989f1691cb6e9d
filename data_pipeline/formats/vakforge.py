"""Reader and validator of vakforge conversation manifests (seed 002, "Validation rules").

A manifest (vakforge.jsonl) holds one conversation per line; `read_vakforge` checks each against
the typed records of `vakforge_schema`, then every rule that relates fields, records and files:
audio, locale packs, turn timing and kinds, the tool-call protocol, entity offsets, provenance
(with the PII re-check of `vakforge_pii`) and splits.json (`vakforge_splits`). It collects every
problem of the file and raises one `FormatError` whose lines read
`PATH:LINE: id=CONV_ID: turns[i].field: message` (DESIGN, "Contracts").

Messages never repeat turn text, system prompts or tool arguments: those may hold personal data
(seed 002: an issue "never repeats the matched value into a terminal or a CI log").

Decisions where the seed leaves room (tool, provenance, PII and split decisions are in the docstrings
of `vakforge_tools`, `vakforge_provenance`, `vakforge_pii` and `vakforge_splits`):
- A turn is exactly one of: spoken (user/agent; text, lang, entities, overlap), a tool call (agent,
  zero duration) or a tool result (speaker "tool"); fields of another kind are refused.
- `overlap` must be true exactly when a spoken turn starts before the previous spoken turn ends
  (the seed's definition); tool turns have no audio, so they neither overlap nor are overlapped.
- A turn may not end more than the audio tolerance (0.5 s) after the recording ends: turns are
  cut from the audio (seed 002, "Time-aligned").
- A 2-channel recording needs a channel_map with "0" and "1", one user and one agent; a mono one
  has none. A `lang` may be declared by the conversation's pack or by the pack of another
  conversation in the same manifest (the seed's "sibling pack in the project").
- Audio paths are checked lexically (relative, `/`-separated, no `..`); a symlink the dataset owner
  placed inside the folder is followed. Redaction logs are always read (they are provenance, not
  media), so `check_media=False` skips audio only.
- Conversation ids are unique within a manifest (splits assign by id).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import get_args

from pydantic import BaseModel, ValidationError

from data_pipeline.formats.errors import FormatError, Problem, ProblemLog
from data_pipeline.formats.jsonl import read_jsonl_objects
from data_pipeline.formats.vakforge_audio import AudioError, probe_audio
from data_pipeline.formats.vakforge_pii import PACKS, LocalePack
from data_pipeline.formats.vakforge_provenance import check_pii, check_provenance, dataset_path_problem
from data_pipeline.formats.vakforge_schema import (
    CONVERSATION_ID_PATTERN,
    Turn,
    VakforgeConversation,
    field_path,
    json_schema,
)
from data_pipeline.formats.vakforge_splits import SPLITS_FILE, VakforgeSplits, check_splits
from data_pipeline.formats.vakforge_tools import check_tools

__all__ = [
    "VakforgeConversation",
    "VakforgeSplits",
    "export_schema",
    "manifest_hash",
    "read_vakforge",
]

# Seed 002: audio "matches declared sample rate/channels/duration ±0.5 s".
AUDIO_TOLERANCE_S = 0.5
_ID = re.compile(CONVERSATION_ID_PATTERN)


def read_vakforge(
    path: str | Path,
    allow_unconsented: bool = False,
    check_media: bool = True,
    splits_path: str | Path | None = None,
) -> list[VakforgeConversation]:
    """Every conversation of one manifest, or a FormatError listing every problem.

    `splits_path` defaults to splits.json next to the manifest. `allow_unconsented` admits
    `meta.consent: "none"` (seed 002: only "with --allow-unconsented"); `check_media=False` skips
    the existence and decoding of audio files.
    """
    path = Path(path)
    source = str(path)
    problems: list[Problem] = []
    parsed: list[tuple[int, VakforgeConversation]] = []
    record_ids: list[tuple[int, str]] = []
    first_line: dict[str, int] = {}
    for number, obj in read_jsonl_objects(path, source, problems):
        cid = _raw_id(obj)
        if cid is not None:
            if cid in first_line:
                problems.append(Problem(
                    source, number, f"id={cid}: id",
                    f"duplicate of line {first_line[cid]}; conversation ids are unique in a manifest",
                ))
            else:
                first_line[cid] = number
                record_ids.append((number, cid))
        conv = _parse(obj, source, number, problems)
        if conv is not None:
            parsed.append((number, conv))
    project_langs = frozenset().union(*(PACKS[c.locale].langs for _, c in parsed if c.locale in PACKS))
    for number, conv in parsed:
        check = _RecordCheck(source, number, conv, path.parent, project_langs, allow_unconsented, check_media)
        check.run()
        problems.extend(check.problems)
    if record_ids:
        splits_file = Path(splits_path) if splits_path is not None else path.parent / SPLITS_FILE
        problems.extend(check_splits(splits_file, source, record_ids, parsed)[1])
    # Manifest problems in line order, then those of splits.json (sort is stable); the log caps
    # how many are shown, like every reader's.
    log = ProblemLog(source)
    log.extend(sorted(problems, key=lambda p: (p.path != source, p.line)))
    log.raise_if_any()
    return [conv for _, conv in parsed]


def export_schema(path: str | Path = "vakforge.schema.json") -> Path:
    """Write the JSON Schema of a manifest line (seed 002, "Layout on disk") and return its path."""
    path = Path(path)
    path.write_text(json.dumps(json_schema(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


def manifest_hash(path: str | Path, conversations: Sequence[VakforgeConversation] | None = None) -> str:
    """`sha256:…` over the manifest, splits.json, and every audio file and redaction log it names.

    Seed 002 ("Adapters"): adapters write a manifest_hash so training runs trace to exact data, and
    audio is data as much as text is. Paths enter relative to the manifest, so a moved dataset keeps
    its hash. `conversations` is what `read_vakforge` returned; without it the manifest is read
    (without decoding audio) and a FormatError stops the hashing of data that does not validate.
    """
    path = Path(path)
    if conversations is None:
        conversations = read_vakforge(path, allow_unconsented=True, check_media=False)
    named = {("manifest", path.name, path), ("splits", SPLITS_FILE, path.parent / SPLITS_FILE)}
    for conv in conversations:
        if conv.audio is not None:
            named.add(("audio", conv.audio.path, path.parent / conv.audio.path))
        if conv.meta.redaction_log is not None:
            named.add(("redaction_log", conv.meta.redaction_log, path.parent / conv.meta.redaction_log))
    outer = hashlib.sha256(b"vakforge-manifest-hash/1\n")
    for role, name, file in sorted(named):
        try:
            with file.open("rb") as data:
                digest = hashlib.file_digest(data, "sha256").hexdigest()
        except OSError as err:
            raise FormatError([Problem(str(file), 0, "file", f"cannot hash: {err.strerror}")]) from None
        outer.update(f"{role}\t{name}\t{digest}\n".encode())
    return f"sha256:{outer.hexdigest()}"


# -- parsing ------------------------------------------------------------------------------------


def _raw_id(obj: object) -> str | None:
    cid = obj.get("id") if isinstance(obj, dict) else None
    return cid if isinstance(cid, str) and _ID.fullmatch(cid) else None


def _parse(obj: object, source: str, line: int, problems: list[Problem]) -> VakforgeConversation | None:
    prefix = f"id={_raw_id(obj) or '?'}: "
    if not isinstance(obj, dict):
        problems.append(Problem(source, line, "record", f"a conversation is a JSON object, got {type(obj).__name__}"))
        return None
    try:
        # Strict JSON mode: strings are never coerced to numbers, floats never truncated to ints.
        return VakforgeConversation.model_validate_json(json.dumps(obj), strict=True)
    except RecursionError:
        problems.append(Problem(source, line, prefix + "record", "nested too deeply"))
    except ValidationError as err:
        for e in err.errors(include_url=False):
            problems.append(Problem(source, line, prefix + (field_path(e["loc"]) or "record"), _message(e)))
    return None


_PATTERN_HINTS = {
    "id": "must be letters, digits, _ . - (starting with a letter or digit, at most 128)",
    "lang": "must be a BCP-47 tag such as en-US, hi-Latn, zh-CN",
    "primary": "must be a BCP-47 tag such as en-US, hi-Latn, zh-CN",
    "mix": "must be a BCP-47 tag such as en, hi, zh-CN",
    "name": "must be 1–64 letters, digits, _ or -",
    "type": "must be snake_case, like customer_id",
    "split": "must be snake_case, like train",
    "conversation_id": "must be a conversation id",
}


def _message(e: dict) -> str:
    kind = e["type"]
    if kind == "missing":
        return "required"
    if kind == "too_short":
        return f"must have at least {e['ctx']['min_length']} item(s)"
    if kind == "json_invalid":
        # Only the re-serialised record is parsed here, so this is depth or an unpaired surrogate escape.
        if "recursion limit" in e["msg"]:
            return "JSON nested too deeply to validate"
        return "a string holds an unpaired surrogate escape (\\ud800-\\udfff), which is not text"
    if kind == "extra_forbidden":
        model = _model_at(e["loc"][:-1])
        allowed = f"; allowed here: {', '.join(model.model_fields)}" if model is not None else ""
        return f"unknown key{allowed}"
    if kind == "string_pattern_mismatch":
        names = [p for p in e["loc"] if isinstance(p, str)]
        return _PATTERN_HINTS.get(names[-1] if names else "", e["msg"])
    return e["msg"].replace("Input should be", "must be").replace("String should", "must")


def _model_at(loc: Sequence[int | str]) -> type[BaseModel] | None:
    model: type[BaseModel] | None = VakforgeConversation
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part) if model is not None else None
        model = _inner_model(field.annotation) if field is not None else None
    return model


def _inner_model(annotation: object) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _inner_model(arg)
        if found is not None:
            return found
    return None


# -- one conversation ---------------------------------------------------------------------------


class _RecordCheck:
    """The checks of one schema-valid conversation; `problems` holds what they found."""

    def __init__(
        self, source: str, line: int, conv: VakforgeConversation, base: Path,
        project_langs: frozenset[str], allow_unconsented: bool, check_media: bool,
    ):
        self.source, self.line, self.conv, self.base = source, line, conv, base
        self.project_langs, self.allow_unconsented, self.check_media = project_langs, allow_unconsented, check_media
        self.problems: list[Problem] = []

    def problem(self, field: str, message: str) -> None:
        self.problems.append(Problem(self.source, self.line, f"id={self.conv.id}: {field}", message))

    def run(self) -> None:
        pack = PACKS.get(self.conv.locale)
        if pack is None:
            self.problem(
                "locale",
                f"{self.conv.locale[:40]!r} is not a registered locale pack; registered: {', '.join(PACKS)}",
            )
        else:
            self.languages(pack)
        self.audio()
        self.turns()
        check_tools(self.conv, self.problem)
        check_provenance(self.conv, self.base, self.allow_unconsented, self.problem)
        if self.conv.meta.pii_redacted and pack is not None:
            check_pii(self.conv, pack, self.problem)

    # -- locale and languages ----------------------------------------------------------------------

    def languages(self, pack: LocalePack) -> None:
        used = [("language.primary", self.conv.language.primary)]
        used += [(f"turns[{i}].lang", t.lang) for i, t in enumerate(self.conv.turns) if t.lang is not None]
        for field, lang in used:
            if lang not in self.project_langs:
                self.problem(
                    field,
                    f"{lang!r} is not declared by the {pack.locale} locale pack ({', '.join(sorted(pack.langs))}) "
                    "or by the pack of another conversation in this manifest",
                )
        mix = self.conv.language.mix
        if mix is not None:
            listed = {tag.split("-")[0] for tag in mix}
            missing: dict[str, str] = {}
            for field, lang in used:
                if lang.split("-")[0] not in listed:
                    missing.setdefault(lang.split("-")[0], field)
            for language, field in missing.items():
                self.problem(
                    "language.mix",
                    f"does not list {language!r}, used by {field}; mix lists every language present",
                )

    # -- audio ---------------------------------------------------------------------------------

    def audio(self) -> None:
        audio = self.conv.audio
        if audio is None:
            return
        if audio.channels == 2:
            cmap = audio.channel_map
            if cmap is None:
                self.problem(
                    "audio.channel_map",
                    'required for 2-channel audio, e.g. {"0": "user", "1": "agent"}; '
                    "write channels: 1 for mixed mono",
                )
            elif set(cmap) != {"0", "1"}:
                self.problem("audio.channel_map", "must map both channels, \"0\" and \"1\"")
            elif sorted(cmap.values()) != ["agent", "user"]:
                self.problem(
                    "audio.channel_map",
                    "must assign one channel to user and the other to agent: two channels of the same "
                    "speaker cannot be split into a conversation",
                )
        elif audio.channel_map is not None:
            self.problem("audio.channel_map", "mono audio has no channel map; its turns come from diarization")
        for i, turn in enumerate(self.conv.turns):
            if turn.end > audio.duration_s + AUDIO_TOLERANCE_S:
                self.problem(
                    f"turns[{i}].end",
                    f"{turn.end} s is past the end of the audio (duration_s {audio.duration_s}); "
                    "turns are cut from the recording",
                )
        wrong = dataset_path_problem(audio.path)
        if wrong is not None:
            self.problem("audio.path", wrong)
            return
        if not self.check_media:
            return
        file = self.base / audio.path
        if not file.is_file():
            what = "not a file" if file.exists() else "file not found"
            self.problem("audio.path", f"{what}: {audio.path} (relative to the manifest's folder)")
            return
        try:
            found = probe_audio(file)
        except AudioError as err:
            self.problem("audio.path", f"does not decode: {err}")
            return
        if found.sample_rate != audio.sample_rate:
            self.problem("audio.sample_rate", f"declared {audio.sample_rate}, the file has {found.sample_rate}")
        if found.channels != audio.channels:
            self.problem("audio.channels", f"declared {audio.channels}, the file has {found.channels}")
        if abs(found.duration_s - audio.duration_s) > AUDIO_TOLERANCE_S:
            self.problem(
                "audio.duration_s",
                f"declared {audio.duration_s} s, the file decodes to {found.duration_s:.3f} s "
                f"(tolerance ±{AUDIO_TOLERANCE_S} s)",
            )

    # -- turns ---------------------------------------------------------------------------------

    def turns(self) -> None:
        turns = self.conv.turns
        last_spoken: int | None = None
        for i, turn in enumerate(turns):
            f = f"turns[{i}]"
            if i and turn.start < turns[i - 1].start:
                self.problem(
                    f"{f}.start",
                    f"{turn.start} s is before turns[{i - 1}].start ({turns[i - 1].start} s); turns are sorted by start",
                )
            if turn.end < turn.start:
                self.problem(f"{f}.end", f"{turn.end} s is before the turn's start ({turn.start} s); end >= start")
            if turn.speaker == "tool":
                self.tool_turn(i, turn)
            elif turn.tool_call is not None:
                self.call_turn(i, turn)
            else:
                self.spoken_turn(i, turn, last_spoken)
                last_spoken = i

    def refuse(self, i: int, turn: Turn, keys: tuple[str, ...], kind: str) -> None:
        for key in keys:
            value = getattr(turn, key)
            if value is not None and value is not False:
                self.problem(
                    f"turns[{i}].{key}",
                    f"not allowed on a {kind} turn; a turn is spoken (text, lang, entities, overlap), "
                    "an agent tool_call, or a tool turn with a tool_result",
                )

    def tool_turn(self, i: int, turn: Turn) -> None:
        if turn.tool_result is None:
            self.problem(f"turns[{i}].tool_result", 'required: a speaker "tool" turn carries a tool_result')
        self.refuse(i, turn, ("text", "lang", "entities", "overlap", "tool_call"), "tool result")

    def call_turn(self, i: int, turn: Turn) -> None:
        if turn.speaker != "agent":
            self.problem(f"turns[{i}].tool_call", "only the agent calls tools; set speaker to \"agent\"")
        if turn.end != turn.start:
            self.problem(f"turns[{i}].end", f"a tool call turn has zero duration; set end = start ({turn.start})")
        self.refuse(i, turn, ("text", "lang", "entities", "overlap", "tool_result"), "tool call")

    def spoken_turn(self, i: int, turn: Turn, last_spoken: int | None) -> None:
        f = f"turns[{i}]"
        if turn.tool_result is not None:
            self.problem(f"{f}.tool_result", 'a result is carried by a speaker "tool" turn of its own')
        if turn.text is None or not turn.text.strip():
            self.problem(f"{f}.text", "required: non-empty text on a spoken turn")
        if turn.lang is None:
            self.problem(f"{f}.lang", "required on every spoken turn; prepare sets it with the pack's detect_lang")
        # Seed 002: overlap is "true when this turn starts before the previous one ends".
        prev = self.conv.turns[last_spoken] if last_spoken is not None else None
        overlapping = prev is not None and turn.start < prev.end
        if turn.overlap and not overlapping:
            where = f"turns[{last_spoken}] ends at {prev.end} s" if prev is not None else "no spoken turn precedes it"
            self.problem(f"{f}.overlap", f"true, but the turn starts at {turn.start} s and {where}; drop it")
        elif overlapping and not turn.overlap:
            self.problem(
                f"{f}.overlap",
                f"required: true, since the turn starts at {turn.start} s, before turns[{last_spoken}] ends ({prev.end} s)",
            )
        self.entities(i, turn)

    def entities(self, i: int, turn: Turn) -> None:
        text = turn.text or ""
        for k, entity in enumerate(turn.entities or ()):
            f = f"turns[{i}].entities[{k}]"
            start, end = entity.start_char, entity.end_char
            if (start is None) != (end is None):
                self.problem(f, "start_char and end_char go together: give both or neither")
            elif start is not None and end is not None and text[start:end] != entity.text:
                # Redaction and entity scoring slice by these offsets (seed 002, "turns[].entities").
                at = text.find(entity.text)
                hint = f"; the entity text occurs at [{at}:{at + len(entity.text)}]" if at >= 0 else ""
                self.problem(
                    f"{f}.start_char",
                    f"text[{start}:{end}] is not the entity text (offsets count code points){hint}",
                )

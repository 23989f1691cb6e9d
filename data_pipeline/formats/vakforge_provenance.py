"""Provenance of a vakforge conversation: claims and their evidence (seed 002, "Provenance claims…").

consent, source, licence and redaction status decide whether a row may lawfully be trained on, so a
record that claims something it cannot show fails: consent needs its reference, real data needs
redaction and a redaction log, real audio needs voice consent, and `pii_redacted: true` is re-checked
by the locale pack over the text the row carries.

Decisions where the seed leaves room:
- A row that claims `pii_redacted: true` is re-checked whatever its source; synthetic rows are
  exempt from having to be redacted, not from having their claim checked.
- Tool JSON is checked value by value (strings, numbers, keys that are not identifiers), and a
  finding names the JSON path and the range in that value, e.g. `turns[3].tool_call.arguments.phone`.
- `meta.redaction_skipped: true` (written by `vakforge prepare --skip-redaction`) stands in for the
  redaction a real row otherwise needs; it requires `pii_redacted: false` and source 'real'.
- A redaction log must be the log of this conversation (`conversation_id`, when given) and its
  spans must name existing turns; span offsets refer to the text before redaction, so they are not
  compared with the redacted text.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath, PureWindowsPath

from pydantic import ValidationError

from data_pipeline.cli_paths import control_character
from data_pipeline.formats.limits import read_file_capped
from data_pipeline.formats.vakforge_pii import LocalePack
from data_pipeline.formats.vakforge_schema import RedactionLog, VakforgeConversation

Report = Callable[[str, str], None]  # (field, message)
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MAX_LOG_ERRORS = 5


def dataset_path_problem(value: str) -> str | None:
    """Why `value` may not name a file of the dataset, or None.

    Seed 002, "audio.path": a manifest is data, often generated or handed over, and must not be
    able to name a file outside the dataset.
    """
    control = control_character(value)
    if control is not None:  # a NUL names no file; a newline would print one problem as two lines
        return (f"{value!r} holds the control character {control!r}; paths with NUL, newlines or other "
                "control characters are refused")
    if "://" in value:
        return "is a URL; it must be a path relative to the manifest's folder"
    if "\\" in value:
        return "must use / as the separator (a manifest is read on any OS)"
    if PurePosixPath(value).is_absolute() or PureWindowsPath(value).drive:
        return "must be relative to the manifest's folder, not absolute"
    if ".." in PurePosixPath(value).parts:
        return "must not contain a .. segment: a manifest may only name files inside its dataset"
    return None


def check_provenance(conv: VakforgeConversation, base: Path, allow_unconsented: bool, problem: Report) -> None:
    meta = conv.meta
    if meta.consent == "none" and not allow_unconsented:
        problem(
            "meta.consent",
            '"none" is accepted only with --allow-unconsented, and such rows are excluded from any '
            "published artifact",
        )
    if meta.consent in ("recorded_verbal", "written") and meta.consent_ref is None:
        problem("meta.consent_ref", f"required when consent is {meta.consent!r}: name the consent record")
    if meta.consent == "public_license" and meta.license is None:
        problem("meta.license", "required when consent is 'public_license': name the licence")
    if meta.consent == "synthetic" and meta.source != "synthetic":
        problem("meta.consent", f"'synthetic' is only valid with source 'synthetic', not {meta.source!r}")
    if meta.redaction_skipped:
        # Seed 002: prepare skips redaction only under --skip-redaction, which marks the rows. A
        # marked real row holds personal data; it validates, and the mark stays for later tools.
        if meta.source != "real":
            problem("meta.redaction_skipped", f"only rows of source 'real' are redacted, not {meta.source!r}")
        if meta.pii_redacted:
            problem("meta.pii_redacted", "must be false when redaction_skipped is true: the text was not redacted")
    elif meta.source == "real":
        if not meta.pii_redacted:
            problem("meta.pii_redacted", "must be true for source 'real': redaction is not optional for real data")
        if meta.redaction_log is None:
            problem("meta.redaction_log", "required for source 'real': a log naming what was removed")
    if meta.source == "real":
        if conv.audio is not None and meta.voice_consent_ref is None:
            problem(
                "meta.voice_consent_ref",
                "required for real audio: consent to record a call is not consent to train a voice on it "
                "(a voiceprint is biometric data under UK GDPR and BIPA)",
            )
    if meta.redaction_log is not None:
        _check_redaction_log(conv, base, meta.redaction_log, problem)


def _check_redaction_log(conv: VakforgeConversation, base: Path, name: str, problem: Report) -> None:
    field = "meta.redaction_log"
    wrong = dataset_path_problem(name)
    if wrong is not None:
        problem(field, wrong)
        return
    try:
        log = RedactionLog.model_validate_json(read_file_capped(base / name).decode("utf-8-sig"), strict=True)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        problem(field, f"file not found: {name} (relative to the manifest's folder)")
        return
    except OSError as err:
        problem(field, f"cannot read {name}: {err.strerror}")
        return
    except UnicodeDecodeError:
        problem(field, f"cannot read {name}: not UTF-8")
        return
    except ValidationError as err:
        for e in err.errors(include_url=False)[:_MAX_LOG_ERRORS]:
            where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e["loc"]).lstrip(".")
            detail = {"missing": "required", "extra_forbidden": "unknown key"}.get(e["type"]) or e["msg"].replace(
                "Input should be", "must be"
            )
            problem(field, f"{name}: {where or 'top level'}: {detail}; a log is a JSON object with a spans list")
        return
    if log.conversation_id is not None and log.conversation_id != conv.id:
        problem(field, f"{name} is the log of {log.conversation_id}, not of this conversation")
    last = len(conv.turns) - 1
    for k, span in enumerate(log.spans):
        if span.turn is not None and span.turn > last:
            problem(field, f"{name}: spans[{k}].turn: {span.turn} is past the last turn (turns[{last}])")
        if span.end <= span.start:
            problem(field, f"{name}: spans[{k}].end: must be greater than start")
        if span.audio is not None and span.audio.end_s < span.audio.start_s:
            problem(field, f"{name}: spans[{k}].audio.end_s: must not be before start_s")


def check_pii(conv: VakforgeConversation, pack: LocalePack, problem: Report) -> None:
    """Seed 002: `pii_redacted: true` is re-checked over system_prompt, turn text and tool JSON."""
    texts: list[tuple[str, str]] = []
    if conv.system_prompt is not None:
        texts.append(("system_prompt", conv.system_prompt))
    for i, turn in enumerate(conv.turns):
        if turn.text is not None:
            texts.append((f"turns[{i}].text", turn.text))
        if turn.tool_call is not None:
            texts += _json_texts(turn.tool_call.arguments, f"turns[{i}].tool_call.arguments")
        if turn.tool_result is not None:
            texts += _json_texts(turn.tool_result.content, f"turns[{i}].tool_result.content")
    for field, text in texts:
        for found in pack.find_pii(text):
            # Type and range only: the value itself must never reach a terminal or a CI log.
            problem(
                field,
                f"pii_redacted is true but the {pack.locale} locale pack finds {found.type} at chars "
                f"[{found.start}:{found.end}]; redact it and log the span, or set pii_redacted: false",
            )


def _json_texts(value: object, field: str) -> Iterator[tuple[str, str]]:
    """(field path, text) of every string, number and non-identifier key of a JSON value."""
    if isinstance(value, dict):
        for n, (key, item) in enumerate(value.items()):
            if _IDENTIFIER.fullmatch(key):
                yield from _json_texts(item, f"{field}.{key}")
            else:
                # A key that is not an identifier may itself be personal data: name it by position.
                yield f"{field}{{key {n}}}", key
                yield from _json_texts(item, f"{field}{{key {n}}}")
    elif isinstance(value, list):
        for k, item in enumerate(value):
            yield from _json_texts(item, f"{field}[{k}]")
    elif isinstance(value, str):
        yield field, value
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield field, repr(value)

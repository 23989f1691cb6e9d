"""Typed records of vakforge conversation manifests (seed 002, "Record").

The pydantic models are the structural source of truth: `vakforge.schema.json` is exported from
`VakforgeConversation.model_json_schema()` (seed 002, "Layout on disk"). Rules that relate fields
to each other, to other records or to files (provenance, tool protocol, audio, splits, PII) live in
`vakforge.py` and its sibling modules, because JSON Schema cannot express them.

Every model refuses unknown keys and validates in strict JSON mode: a string is never coerced to
a number, nor a float to an integer (DESIGN: no silent fallbacks).

Decisions where the seed leaves room:
- Required: id, schema_version, locale, language, turns, meta (and in meta: source, consent,
  pii_redacted, the provenance the seed says travels with every row). Optional: audio (seed: "audio
  — optional"), domain, scenario, system_prompt (records from chat logs may have none), tools.
- `meta.speakers` (agent voice id, customer id where known) is added: the seed's split rule ("no
  speaker … appears in more than one split") needs speaker identities and the record names none.
- A conversation id is `[A-Za-z0-9][A-Za-z0-9_.-]*`: it names files (redactions/ID.json) and is
  printed as `id=ID:` in every problem line, where a colon or a space would be ambiguous.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, JsonValue

SCHEMA_VERSION = "0.1"
CONVERSATION_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$"
# BCP-47 as far as vakforge uses it: language, optional script, optional region (seed: en-US,
# hi-Latn, hi-Latn-IN, zh-CN). Case follows the BCP-47 conventions, so tags compare exactly.
LANG_TAG_PATTERN = r"^[a-z]{2,3}(-[A-Z][a-z]{3})?(-([A-Z]{2}|[0-9]{3}))?$"
# OpenAI function names, so the same records drive serving (seed 002, "tool_call / tool_result").
TOOL_NAME_PATTERN = r"^[A-Za-z0-9_\-]{1,64}$"
SNAKE_CASE_PATTERN = r"^[a-z][a-z0-9_]*$"

ConversationId = Annotated[str, Field(pattern=CONVERSATION_ID_PATTERN)]
LangTag = Annotated[str, Field(pattern=LANG_TAG_PATTERN)]
ToolName = Annotated[str, Field(pattern=TOOL_NAME_PATTERN)]
NonEmpty = Annotated[str, Field(min_length=1)]
Seconds = Annotated[float, Field(ge=0)]


class _Record(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)


class Audio(_Record):
    """The recording of a conversation; `path` is relative to the manifest's folder, never with `..`."""

    path: NonEmpty
    sample_rate: int = Field(gt=0)
    channels: int = Field(ge=1, le=2, description="2 = dual-stream (needs channel_map), 1 = mixed mono")
    channel_map: dict[Literal["0", "1"], Literal["user", "agent"]] | None = None
    duration_s: float = Field(gt=0)
    condition: Literal["studio", "clean", "phone", "noisy"] | None = None


class Language(_Record):
    """`primary` is a BCP-47 tag; `mix` lists every language present in the conversation."""

    primary: LangTag
    mix: list[LangTag] | None = Field(default=None, min_length=1)


class Tool(_Record):
    """A function the agent may call; `parameters` is a JSON Schema for the call's arguments."""

    name: ToolName
    description: str | None = None
    parameters: dict[str, JsonValue]


class ToolCall(_Record):
    """OpenAI-style function call, issued by an agent turn of zero duration."""

    id: NonEmpty
    name: ToolName
    arguments: dict[str, JsonValue]


class ToolResult(_Record):
    """The answer to one earlier call; `content` is any JSON value (object, list, string, number…)."""

    id: NonEmpty
    content: JsonValue


class Entity(_Record):
    """A business entity in a turn; when given, text[start_char:end_char] equals `text` (code points)."""

    type: Annotated[str, Field(pattern=SNAKE_CASE_PATTERN)]
    text: NonEmpty
    normalized: JsonValue = None
    start_char: int | None = Field(default=None, ge=0)
    end_char: int | None = Field(default=None, ge=0)


class Turn(_Record):
    """A spoken turn (text + lang), an agent tool call (zero duration) or a tool turn with a result."""

    speaker: Literal["user", "agent", "tool"]
    start: Seconds
    end: Seconds
    text: str | None = None
    lang: LangTag | None = None
    overlap: bool = False
    entities: list[Entity] | None = None
    tool_call: ToolCall | None = None
    tool_result: ToolResult | None = None


class Transcription(_Record):
    engine: NonEmpty
    verified_by_human: bool


class Diarization(_Record):
    engine: NonEmpty
    confidence: float | None = Field(default=None, ge=0, le=1)


class Speakers(_Record):
    """Speaker identities for leak-free splits: the agent voice and, where known, the customer.

    Use pseudonymous ids (voice or customer keys), never names or phone numbers.
    """

    agent: NonEmpty | None = None
    user: NonEmpty | None = None


class Meta(_Record):
    """Provenance: every claim here must carry its evidence (seed 002, "Provenance claims…")."""

    source: Literal["real", "synthetic", "public"]
    consent: Literal["recorded_verbal", "written", "synthetic", "public_license", "none"]
    consent_ref: NonEmpty | None = None
    voice_consent_ref: NonEmpty | None = None
    license: NonEmpty | None = None
    pii_redacted: bool
    redaction_log: NonEmpty | None = None
    # Seed 002: `prepare --skip-redaction` "logs a loud warning and marks the rows"; this is the mark.
    redaction_skipped: bool = False
    transcription: Transcription | None = None
    diarization: Diarization | None = None
    speakers: Speakers | None = None
    split: Annotated[str, Field(pattern=SNAKE_CASE_PATTERN)] | None = None
    created: AwareDatetime | None = None


class VakforgeConversation(_Record):
    """One line of vakforge.jsonl: one conversation (seed 002)."""

    id: ConversationId
    schema_version: Literal["0.1"]
    audio: Audio | None = None
    locale: NonEmpty
    language: Language
    domain: NonEmpty | None = None
    scenario: NonEmpty | None = None
    system_prompt: str | None = None
    tools: list[Tool] = Field(default_factory=list)
    turns: list[Turn] = Field(min_length=1)
    meta: Meta


class RedactedAudio(_Record):
    start_s: Seconds
    end_s: Seconds
    method: NonEmpty


class RedactionSpan(_Record):
    """What was removed: offsets into the original (pre-redaction) text, so not checked against it."""

    turn: int | None = Field(default=None, ge=0)
    field: NonEmpty
    type: NonEmpty
    start: int = Field(ge=0)
    end: int = Field(ge=0)
    placeholder: str | None = None
    audio: RedactedAudio | None = None


class RedactionLog(_Record):
    """The file `meta.redaction_log` names (seed 002: "a JSON object with a spans list")."""

    conversation_id: ConversationId | None = None
    spans: list[RedactionSpan]


def json_schema() -> dict:
    """The JSON Schema written to vakforge.schema.json for external validators."""
    schema = VakforgeConversation.model_json_schema()
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}


def field_path(loc) -> str:
    """A pydantic error location as this project's field path: `turns[3].text`."""
    out = ""
    for part in loc:
        if part == "[key]":  # pydantic's marker for a bad dict key; the key itself is the last part
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out

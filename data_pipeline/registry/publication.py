"""Rows the registry refuses to publish, whatever else they pass (seed 002, "meta.consent", "Provenance
claims must carry their evidence").

The registry is how a dataset reaches other people, so a registered version is a published artifact:
- `meta.consent: "none"` "is allowed only with --allow-unconsented and is excluded from any published
  artifact". The registry therefore validates vakforge with unconsented rows admitted (the rest of
  the row is still checked) and refuses them here, so this module is the one place that says why a
  row may not be published, and the validator's "--allow-unconsented" hint (a flag register does not
  have) never reaches a registering user.
- `meta.redaction_skipped: true` is the mark `vakforge prepare --skip-redaction` puts on a real row it
  left unredacted: the row validates (training in-house on it is the owner's call) but still holds
  the personal data redaction would have removed.

There is no override: "excluded from any published artifact" leaves no room for one. Every such row is
named (`PATH:LINE: id=…: meta.field: …`, capped like a validator's problems) before anything is
uploaded or indexed.
"""

from __future__ import annotations

import json
from pathlib import Path

from data_pipeline.formats.errors import Problem, ProblemLog
from data_pipeline.formats.jsonl import iter_jsonl_objects
from data_pipeline.formats.vakforge_schema import Meta
from data_pipeline.registry.references import RegistryError

# Options the registry passes to a format's validator: consent is judged below, not by the validator.
VALIDATE_OPTIONS: dict[str, dict[str, object]] = {"vakforge": {"allow_unconsented": True}}

_NO_CONSENT = ('"none": a row without consent is excluded from any published artifact (seed 002); '
               "record the person's consent (meta.consent with its consent_ref), or drop the row")
_UNREDACTED = ("true: `vakforge prepare --skip-redaction` left this real row unredacted, so it holds "
               "personal data; run prepare without --skip-redaction, or drop the row")


def unpublishable(path: Path, fmt: str) -> tuple[ProblemLog, int]:
    """The rows of a validated file that may not be published (one problem per reason), and their count."""
    source = str(path)
    found, rows = ProblemLog(source), 0
    if fmt != "vakforge":  # the only format whose rows carry consent and redaction status
        return found, rows
    unreadable = ProblemLog(source)
    for number, obj in iter_jsonl_objects(path, source, unreadable):
        # The validator's own typed Meta (strict JSON mode, as it reads it), not a second reading of keys.
        meta = Meta.model_validate_json(json.dumps(obj["meta"]), strict=True)
        where = f"id={obj['id']}: "
        reasons = [("meta.consent", _NO_CONSENT)] if meta.consent == "none" else []
        reasons += [("meta.redaction_skipped", _UNREDACTED)] if meta.redaction_skipped else []
        rows += bool(reasons)
        found.extend([Problem(source, number, where + field, message) for field, message in reasons])
    if unreadable:  # the file passed its validator, so only a change since then gets here
        raise RegistryError(f"{path} changed while it was being registered:\n" +
                            "\n".join(map(str, unreadable.report())))
    return found, rows


def check_publishable(path: Path, fmt: str) -> None:
    """Raise a RegistryError listing every row of `path` that may not be published."""
    found, rows = unpublishable(path, fmt)
    if found:
        lines = "\n".join(str(problem) for problem in found.report())
        raise RegistryError(f"{path}: {rows} {'row' if rows == 1 else 'rows'} may not be published (seed 002); nothing was registered:\n{lines}")

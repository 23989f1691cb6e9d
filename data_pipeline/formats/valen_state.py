"""The `request.state` of a Valen record, its media and the `assets` manifest (seed 000).

Seed 000 "Images and video": a state is a text string or `{"messages": [...]}`; messages have a
role (user, assistant, system) and content that is a string or a list of parts
`{"type": "text", "text": …}`, `{"type": "image_url", "image_url": {"url": …}}` or
`{"type": "video_url", "video_url": {"url": …}}`. Media paths are relative to the JSONL's folder or
absolute; anything containing `://` is refused. Digests are compared only where `assets` lists the
same path; unlisted media is still read and its digest recorded.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from data_pipeline.formats.errors import LineProblems, describe, member, quote
from data_pipeline.formats.media_decode import image_problem
from data_pipeline.formats.media_paths import DatasetFolder

ROLES = ("user", "assistant", "system")
MEDIA_PARTS = {"image_url": "image", "video_url": "video"}  # part type -> ResolvedMedia.kind
_STATE_KEYS = frozenset({"messages"})
_MESSAGE_KEYS = frozenset({"role", "content"})
_ASSET_KEYS = ("path", "sha256")
_ASSET_KEYSET = frozenset(_ASSET_KEYS)
_TEXT_PART_KEYS = frozenset({"type", "text"})
_MEDIA_PART_KEYS = {kind: frozenset({"type", kind}) for kind in MEDIA_PARTS}
_URL_KEYS = frozenset({"url"})
_SHA256 = re.compile(r"[0-9a-fA-F]{64}")

# (field of the url, part type, url as written) of each media part, in message order.
MediaRefs = list[tuple[str, str, str]]


@dataclass(frozen=True, slots=True)
class Part:
    type: str  # "text" | "image_url" | "video_url"
    text: str | None = None  # text parts
    url: str | None = None  # media parts, as written


@dataclass(frozen=True, slots=True)
class Message:
    role: str  # "user" | "assistant" | "system"
    content: str | tuple[Part, ...]


@dataclass(frozen=True, slots=True)
class StateMessages:
    messages: tuple[Message, ...]


@dataclass(frozen=True, slots=True)
class Asset:
    path: str  # as written
    sha256: str  # lowercase hex


@dataclass(frozen=True, slots=True)
class ResolvedMedia:
    kind: str  # "image" | "video"
    url: str  # as written in the message
    path: Path  # absolute, normalised
    sha256: str | None  # None when read without check_media


def is_text(value: object) -> bool:
    """A string with at least one non-whitespace character (the seed's "non-empty")."""
    return type(value) is str and bool(value) and not value.isspace()


class MediaFiles:
    """Resolves media paths against the JSONL's folder and hashes each file once per read."""

    _CACHE_LIMIT = 4096  # distinct files remembered; bounded so a huge file keeps bounded memory

    def __init__(self, folder: Path, check: bool, allow_outside: bool = False):
        self.folder = os.path.normpath(folder.resolve())
        self.check = check
        self._digests: dict[str, tuple[str | None, str | None]] = {}
        # Absolute paths and paths leaving the folder are refused unless the user allows them
        # (seed 000: "local absolute paths also work" — with the converter option, media_paths).
        self.dataset = DatasetFolder(self.folder, allow_outside)

    def refusal(self, written: str, path: str) -> str | None:
        """Why the media path `written` (resolved to `path`) may not be read, or None."""
        return self.dataset.refusal(written, path)

    def resolve(self, written: str) -> str:
        # normpath, not Path.resolve: no file-system access, and a path the OS cannot encode (a lone
        # surrogate, a NUL) becomes a "not found" problem below instead of a crash here.
        return os.path.normpath(os.path.join(self.folder, written))

    def sha256(self, path: str) -> tuple[str | None, str | None]:
        """(hex digest, None) of a regular file, or (None, why it cannot be read)."""
        if path in self._digests:
            return self._digests[path]
        if len(self._digests) >= self._CACHE_LIMIT:
            self._digests.clear()
        try:
            if not os.path.isfile(path):
                found: tuple[str | None, str | None] = (None, f"file not found: {path}")
            else:
                with open(path, "rb") as handle:
                    found = (hashlib.file_digest(handle, "sha256").hexdigest(), None)
        except OSError as err:
            found = (None, f"cannot read {path}: {err.strerror}")
        except ValueError:
            found = (None, f"file not found: {path}")
        self._digests[path] = found
        return found


def read_state(line: LineProblems, state: object, refs: MediaRefs) -> str | StateMessages | None:
    """The state as a string or messages; media parts are appended to `refs`."""
    if type(state) is str:
        return state
    field = "request.state"
    if type(state) is not dict:
        line.problem(field, f'must be a text string or {{"messages": [...]}}, got {describe(state)}')
        return None
    for key in sorted(state.keys() - _STATE_KEYS):
        line.problem(member(field, key), 'unknown key; a message state is {"messages": [...]}')
    messages = state.get("messages")
    if type(messages) is not list or not messages:
        line.problem(f"{field}.messages", f"required: a non-empty list of messages, got {describe(messages)}")
        return None
    before = len(line.problems)
    read = tuple(_message(line, f"{field}.messages[{i}]", m, refs) for i, m in enumerate(messages))
    if len(line.problems) > before:
        return None
    return StateMessages(read)  # type: ignore[arg-type]  # no problem means no None in `read`


def _message(line: LineProblems, field: str, message: object, refs: MediaRefs) -> Message | None:
    if type(message) is not dict:
        line.problem(field, f'a message is an object {{"role": …, "content": …}}, got {describe(message)}')
        return None
    for key in sorted(message.keys() - _MESSAGE_KEYS):
        line.problem(member(field, key), "unknown key; a message has role and content")
    role = message.get("role")
    if role not in ROLES:
        hint = ""
        if isinstance(role, str) and role.lower() in ROLES:
            hint = f"; roles are lowercase: {quote(role.lower())}"
        line.problem(f"{field}.role", f"must be user, assistant or system; got {describe(role)}{hint}")
    content = message.get("content")
    if type(content) is str:
        return Message(str(role), content)
    if type(content) is not list or not content:
        line.problem(
            f"{field}.content",
            f"required: a text string or a non-empty list of parts, got {describe(content)}",
        )
        return None
    parts = tuple(_part(line, f"{field}.content[{j}]", part, refs) for j, part in enumerate(content))
    if None in parts:
        return None
    return Message(str(role), parts)  # type: ignore[arg-type]


def _part(line: LineProblems, field: str, part: object, refs: MediaRefs) -> Part | None:
    shapes = 'text parts are {"type": "text", "text": …}; media parts {"type": "image_url", "image_url": {"url": …}}'
    if type(part) is not dict:
        line.problem(field, f"a content part is an object; {shapes}; got {describe(part)}")
        return None
    kind = part.get("type")
    if kind != "text" and (type(kind) is not str or kind not in MEDIA_PARTS):
        hint = ""
        if isinstance(kind, str) and kind.lower() in ("text", *MEDIA_PARTS):
            hint = f"; types are lowercase: {quote(kind.lower())}"
        line.problem(f"{field}.type", f"must be text, image_url or video_url; got {describe(kind)}{hint}")
        return None
    ok = True
    for key in sorted(part.keys() - {"type", kind}):
        line.problem(member(field, key), f"unknown key; a {kind} part has type and {kind}")
        ok = False
    if kind == "text":
        text = part.get("text")
        if type(text) is not str:
            line.problem(f"{field}.text", f"required: a string, got {describe(text)}")
            return None
        return Part("text", text=text) if ok else None
    holder = part.get(kind)
    if type(holder) is not dict:
        line.problem(f"{field}.{kind}", f'required: an object {{"url": …}}, got {describe(holder)}')
        return None
    for key in sorted(holder.keys() - {"url"}):
        line.problem(member(f"{field}.{kind}", key), f"unknown key; {kind} holds only url")
        ok = False
    url = holder.get("url")
    if not _media_path(line, f"{field}.{kind}.url", url) or not ok:
        return None
    refs.append((f"{field}.{kind}.url", kind, url))
    return Part(kind, url=url)


def _media_path(line: LineProblems, field: str, value: object) -> bool:
    if not is_text(value):
        line.problem(field, f"required: a non-empty local path, got {describe(value)}")
        return False
    if "://" in value:  # type: ignore[operator]
        # Seed 000: "Paths containing :// are rejected, including HTTP URLs and file://".
        line.problem(field, f"{describe(value)} is a URL; save the media locally and give its path")
        return False
    return True


def read_assets(line: LineProblems, obj: dict, files: MediaFiles) -> tuple[Asset, ...]:
    """The `assets` manifest; two entries naming one file with different digests are refused."""
    if "assets" not in obj:
        return ()
    assets = obj["assets"]
    if type(assets) is not list:
        hint = "; omit it or use []" if assets is None else ""
        line.problem("assets", f"must be a list of {{path, sha256}} entries, got {describe(assets)}{hint}")
        return ()
    found: list[Asset] = []
    first: dict[str, tuple[int, str]] = {}  # resolved path -> (index, sha256) of its first entry
    for j, entry in enumerate(assets):
        field = f"assets[{j}]"
        if type(entry) is not dict:
            line.problem(field, f'an asset is an object {{"path": …, "sha256": …}}, got {describe(entry)}')
            continue
        before = len(line.problems)
        for key in sorted(entry.keys() - set(_ASSET_KEYS)):
            line.problem(member(field, key), "unknown key; an asset has path and sha256")
        for key in _ASSET_KEYS:
            if key not in entry:
                line.problem(f"{field}.{key}", "required")
        path, digest = entry.get("path"), entry.get("sha256")
        if "path" in entry:
            _media_path(line, f"{field}.path", path)
        if "sha256" in entry and (type(digest) is not str or not _SHA256.fullmatch(digest)):
            line.problem(f"{field}.sha256", f"must be 64 hexadecimal characters, got {describe(digest)}")
        if len(line.problems) > before:
            continue
        digest = digest.lower()
        resolved = files.resolve(path)
        if resolved in first and first[resolved][1] != digest:
            line.problem(
                f"{field}.sha256", f"assets[{first[resolved][0]}] names the same file with another sha256"
            )
            continue
        first.setdefault(resolved, (j, digest))
        found.append(Asset(path, digest))
    return tuple(found)


def resolve_media(
    line: LineProblems, refs: MediaRefs, assets: tuple[Asset, ...], files: MediaFiles
) -> tuple[ResolvedMedia, ...]:
    """Each media part with its absolute path and, with `files.check`, its checked sha256."""
    if not refs:
        return ()
    listed = {files.resolve(asset.path): asset.sha256 for asset in assets}
    media = []
    for field, kind, url in refs:
        path = files.resolve(url)
        refusal = files.refusal(url, path)
        if refusal is not None:
            line.problem(field, refusal)
            continue
        digest = None
        if files.check:
            digest, why = files.sha256(path)
            if why is not None:
                line.problem(field, why)
            elif path in listed and listed[path] != digest:
                line.problem(field, f"the file's sha256 is {digest}, but assets lists {listed[path]}")
            elif MEDIA_PARTS[kind] == "image" and (why := image_problem(path, digest)) is not None:
                # Decoded as the training loader will (issue 54; once per distinct content).
                line.problem(field, why)
        media.append(ResolvedMedia(MEDIA_PARTS[kind], url, Path(path), digest))
    return tuple(media)


def plain_media(state: object, assets: object, files: MediaFiles) -> bool:
    """Whether a state, an `assets` value ([] when the record has none) and the media they name
    plainly pass every rule above, checked without building or explaining anything.

    The fast path of `valen_check.plain_counts` for records with messages or assets; False leaves
    the decision to the explaining functions above (a strict subset of what they accept).
    """
    urls: list[tuple[str, bool]] = []  # (url as written, whether it is an image)
    if type(state) is not str:
        if type(state) is not dict or state.keys() != _STATE_KEYS:
            return False
        messages = state["messages"]
        if type(messages) is not list or not messages:
            return False
        for message in messages:
            if type(message) is not dict or message.keys() != _MESSAGE_KEYS or message["role"] not in ROLES:
                return False
            content = message["content"]
            if type(content) is str:
                continue
            if type(content) is not list or not content:
                return False
            for part in content:
                if type(part) is not dict:
                    return False
                kind = part.get("type")
                if kind == "text":
                    if part.keys() != _TEXT_PART_KEYS or type(part["text"]) is not str:
                        return False
                    continue
                if (kind != "image_url" and kind != "video_url") or part.keys() != _MEDIA_PART_KEYS[kind]:
                    return False
                holder = part[kind]
                if type(holder) is not dict or holder.keys() != _URL_KEYS:
                    return False
                url = holder["url"]
                if type(url) is not str or not url or url.isspace() or "://" in url:
                    return False
                urls.append((url, kind == "image_url"))
    if type(assets) is not list:
        return False
    listed: dict[str, str] = {}  # resolved path -> sha256
    for entry in assets:
        if type(entry) is not dict or entry.keys() != _ASSET_KEYSET:
            return False
        path, digest = entry["path"], entry["sha256"]
        if type(path) is not str or not path or path.isspace() or "://" in path:
            return False
        if type(digest) is not str or not _SHA256.fullmatch(digest):
            return False
        digest = digest.lower()
        if listed.setdefault(files.resolve(path), digest) != digest:
            return False
    for url, image in urls:
        path = files.resolve(url)
        if files.refusal(url, path) is not None:
            return False
        if files.check:
            digest, why = files.sha256(path)
            if why is not None or listed.get(path, digest) != digest:
                return False
            if image and image_problem(path, digest) is not None:
                return False
    return True

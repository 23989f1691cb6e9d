"""The grouping and dealing every split shares (issue 17): split names and fractions, the groups that must
stay together (a Valen group_id, a vakforge speaker, a media file's content), and the seeded deal of groups
into splits. `python -m data_pipeline.split` and `python -m data_pipeline.vakforge split` both split with
these; they live apart from either command so that the generic split can hand vakforge manifests to the
vakforge one (which honours `meta.split`) without an import circle.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from data_pipeline.cli_paths import PathError, check_path
from data_pipeline.shards import sha256_file

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
    """The SHA-256 of a media file, streamed (a file of any size costs one buffer; /dev/zero is no file)."""
    try:
        check_path(f"{where}: media", name)
    except PathError as error:
        raise SplitError(str(error)) from None
    path = Path(name) if Path(name).is_absolute() else folder / name
    if path not in cache:
        if path.exists() and not path.is_file():
            raise SplitError(f"{where}: media {name!r}: not a regular file")
        try:
            cache[path] = sha256_file(path)
        except OSError as error:
            raise SplitError(f"{where}: media {name!r}: {error.strerror or error}") from None
    return cache[path]


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

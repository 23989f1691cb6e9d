"""Registry reference syntax (seed 003, "Register a dataset").

    ns/name            the version the `latest` alias points at (always the newest)
    ns/name:v3         version 3
    ns/name:candidate  the version the alias `candidate` points at
    ns/name@sha256:HEX the version with that digest
    name, name:v3 ...  the same in a default namespace (a run's project); commands have none

References are case-insensitive (`Triage/Train` is `triage/train`). Names and aliases are
`[a-z0-9][a-z0-9_-]*` (at most 64 characters): no dots and no further slashes, so a file name
such as `train.jsonl` or `data/train.jsonl` is never a reference, and an existing local path
never is one either.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

NAME = r"[a-z0-9][a-z0-9_-]{0,63}"
LATEST = "latest"
_REFERENCE = re.compile(
    rf"^(?:(?P<namespace>{NAME})/)?(?P<name>{NAME})"
    rf"(?::(?P<tag>{NAME})|@sha256:(?P<digest>[0-9a-f]{{64}}))?$"
)
_VERSION_TAG = re.compile(r"^v([0-9]+)$")


class RegistryError(ValueError):
    """A registry request that cannot be done; the message names the reference, file or limit."""


@dataclass(frozen=True)
class Reference:
    namespace: str
    name: str
    version: int | None = None  # ns/name:vN
    alias: str | None = None  # ns/name:ALIAS (`latest` for a bare ns/name)
    digest: str | None = None  # "sha256:<hex>" for ns/name@sha256:…

    @property
    def qualified(self) -> str:
        return f"{self.namespace}/{self.name}"


def is_reference(text: str) -> bool:
    """True when `text` is written like a registry reference and names no existing local path."""
    if not isinstance(text, str) or os.path.exists(text):
        return False
    return _REFERENCE.match(text.strip().lower()) is not None


def parse_reference(text: str, default_namespace: str | None = None) -> Reference:
    """The parts of a reference; a namespace-less one takes `default_namespace` or is refused."""
    if not isinstance(text, str):
        raise RegistryError(f"registry reference {text!r}: expected a string like ns/name:v3")
    match = _REFERENCE.match(text.strip().lower())
    if match is None:
        raise RegistryError(
            f"registry reference {text!r}: write ns/name, ns/name:vN, ns/name:ALIAS or ns/name@sha256:HEX "
            f"(names are letters, digits, '-' and '_')"
        )
    namespace = match["namespace"]
    if namespace is None:
        if not default_namespace:
            raise RegistryError(
                f"registry reference {text!r} names no namespace and there is no default one here: "
                f"write NAMESPACE/{text.strip().lower()}"
            )
        namespace = default_namespace.strip().lower()
        if not re.fullmatch(NAME, namespace):
            raise RegistryError(f"default namespace {default_namespace!r}: not a valid namespace name")
    tag, digest = match["tag"], match["digest"]
    if digest is not None:
        return Reference(namespace, match["name"], digest=f"sha256:{digest}")
    if tag is None:
        return Reference(namespace, match["name"], alias=LATEST)
    version = _VERSION_TAG.match(tag)
    if version is not None:
        return Reference(namespace, match["name"], version=int(version[1]))
    return Reference(namespace, match["name"], alias=tag)


def parse_qualified(text: str) -> Reference:
    """A dataset name `ns/name` as register/versions take it: namespace required, no version part."""
    ref = parse_reference(text)
    if ref.alias != LATEST or ref.version is not None or ref.digest is not None or ":" in text or "@" in text:
        raise RegistryError(f"dataset name {text!r}: write NAMESPACE/NAME without a version, alias or digest")
    return ref


def check_alias_name(alias: str) -> str:
    alias = alias.strip().lower()
    if not re.fullmatch(NAME, alias):
        raise RegistryError(f"alias {alias!r}: letters, digits, '-' and '_' only")
    if alias == LATEST:
        raise RegistryError("alias 'latest' always points at the newest version; it cannot be set")
    if _VERSION_TAG.match(alias):
        raise RegistryError(f"alias {alias!r} reads as a version number; choose another name")
    return alias

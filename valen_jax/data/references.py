"""Registry references in a run's data (seed 003, issue 17): resolved before any device is claimed.

`config.data.train` / `config.data.eval` (each a path, a registry reference, or a mixture list of
(path-or-reference, weight)) may name a registered dataset: `ns/name` (the `latest` alias),
`ns/name:v3`, `ns/name:alias`, `ns/name@sha256:…`; a reference without a namespace takes
`config.data.namespace`. The registry is `config.data.registry` (empty: `$VALEN_REGISTRY` or the
user cache). Seed 003: "Optimize resolves a dataset reference when it accepts a run ... It records
the exact version, so moving an alias later does not change the training data."

So `resolve_config_data(config, workdir)`:
- replaces each reference in the config by the resolved version's local file, in place;
- returns what to record in the checkpoint meta (`data_references`): per field, the reference as
  written and the canonical `ns/name:vN`, version and digest it resolved to;
- on a workdir that already holds a checkpoint with those records, resolves the RECORDED version
  (`ns/name:vN`) instead of the written reference, and says so in a log line, so a resumed run keeps
  training on the data it started with after an alias moved;
- refuses an unknown reference, or a dataset registered in another format than the field's, with a
  ConfigError naming the field.

It reads checkpoint metas as plain JSON files: nothing here touches a JAX backend.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from valen_jax.errors import ConfigError

log = logging.getLogger(__name__)

FIELDS = (("train", "format"), ("eval", "eval_format"))
META_KEY = "data_references"


def recorded_references(workdir: str | Path | None) -> dict[str, Any] | None:
    """The `data_references` of the newest checkpoint meta in `workdir` that has them, else None.

    Finished Orbax steps are directories named by their number (saves under way carry a suffix);
    a meta that cannot be read is skipped, the checkpoint restore reports a damaged one."""
    if workdir is None:
        return None
    root = Path(workdir) / "checkpoints"
    if not root.is_dir():
        return None
    steps = sorted((int(p.name) for p in root.iterdir() if p.name.isdigit()), reverse=True)
    for step in steps:
        try:
            meta = json.loads((root / str(step) / "meta" / "metadata").read_text())
        except (OSError, ValueError):
            continue
        if META_KEY in meta:
            return meta[META_KEY]
    return None


def _registry(config):
    from data_pipeline import registry
    return registry.open_registry(str(config.data.registry) or None)


def _resolve_one(config, registry, where: str, text: str, fmt: str, recorded: dict | None) -> tuple[str, dict]:
    from data_pipeline.registry import RegistryError
    namespace = str(config.data.namespace) or None
    wanted = text
    if recorded is not None and recorded.get("written") == text:
        wanted = recorded["reference"]
    try:
        resolved = registry.resolve(wanted, default_namespace=namespace)
    except RegistryError as error:
        raise ConfigError(f"config.{where}={text!r}: {error}") from None
    if recorded is not None and wanted != text:
        if resolved.digest != recorded["digest"]:
            raise ConfigError(f"config.{where}={text!r}: the checkpoint recorded {recorded['reference']} with digest "
                              f"{recorded['digest']}, the registry now gives {resolved.digest}")
        try:
            now = registry.resolve(text, default_namespace=namespace).reference
        except RegistryError:
            now = "nothing (no longer resolvable)"
        log.info("resuming: config.%s=%s uses the recorded version %s (%s); the reference now names %s",
                 where, text, resolved.reference, resolved.digest, now)
    if resolved.format != fmt:
        raise ConfigError(f"config.{where}={text!r} resolves to {resolved.reference}, registered as format "
                          f"{resolved.format!r}; the config reads it as {fmt!r}")
    record = {"written": text, "reference": resolved.reference, "version": int(resolved.version),
              "digest": resolved.digest, "format": resolved.format}
    log.info("config.%s=%s resolved to %s (%s) at %s", where, text, resolved.reference, resolved.digest,
             resolved.path)
    return str(resolved.path), record


def resolve_config_data(config, workdir: str | Path | None = None) -> dict[str, Any]:
    """Resolve the registry references of `config.data.train`/`eval` in place; {field: record(s)}."""
    from data_pipeline.registry import is_reference
    recorded = recorded_references(workdir) or {}
    found: dict[str, Any] = {}
    registry = None
    for key, fmt_key in FIELDS:
        value = config.data[key]
        fmt = str(config.data[fmt_key])
        where = f"data.{key}"
        if isinstance(value, str):
            if not is_reference(value):
                continue
            registry = registry or _registry(config)
            path, record = _resolve_one(config, registry, where, value, fmt, recorded.get(key))
            config.data[key] = path
            found[key] = record
        elif isinstance(value, (list, tuple)):  # a mixture: (path-or-reference, weight) pairs
            items, records = [], []
            previous = recorded.get(key) if isinstance(recorded.get(key), list) else []
            for i, (item, weight) in enumerate(value):
                if isinstance(item, str) and is_reference(item):
                    registry = registry or _registry(config)
                    old = next((r for r in previous if r.get("written") == item), None)
                    item, record = _resolve_one(config, registry, f"{where}[{i}]", item, fmt, old)
                    records.append(record)
                items.append((item, weight))
            if records:
                config.data[key] = type(value)(items)
                found[key] = records
    return found


def resolve_cli_data(data: str, registry_url: str | None = None, namespace: str | None = None
                     ) -> tuple[str, dict[str, Any] | None]:
    """`--data` of evaluate/predict: a registry reference becomes (its version's local file, the record
    of what it resolved to); a path is returned as is. An unknown reference exits with one line."""
    from data_pipeline.registry import RegistryError, is_reference, open_registry
    if not is_reference(data):
        return data, None
    try:
        resolved = open_registry(registry_url or None).resolve(data, default_namespace=namespace or None)
    except RegistryError as error:
        raise SystemExit(f"--data={data}: {error}") from None
    log.info("--data=%s resolved to %s (%s)", data, resolved.reference, resolved.digest)
    return str(resolved.path), {"written": data, "reference": resolved.reference, "version": int(resolved.version),
                                "digest": resolved.digest, "format": resolved.format}

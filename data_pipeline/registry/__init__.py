"""The dataset registry (seed 003, "Register a dataset"; issue 17): named, versioned, immutable
datasets with movable aliases and digest references, shared by a team through one location.

    from data_pipeline.registry import open_registry
    registry = open_registry("/tmp/registry")
    registry.register("smoke/chat", Path("data/smoke/chat/train.jsonl"), "chat")   # smoke/chat:v1
    registry.resolve("smoke/chat").path   # a local chat JSONL the converters read

Modules: references (reference syntax), store (content-addressed blobs, fsspec), index (SQLite),
content (validation, manifests, materialising), publication (rows that may not be published),
core (Registry), __main__ (the CLI).
Not to be confused with `data_pipeline.format_registry`, the table of input formats, which the
registry uses to validate every file it registers.
"""

from data_pipeline.registry.core import (
    MissingImagesError,
    Registry,
    Resolved,
    open_registry,
    registry_location,
)
from data_pipeline.registry.references import RegistryError, is_reference, parse_reference

__all__ = ["MissingImagesError", "Registry", "RegistryError", "Resolved", "is_reference", "open_registry",
           "parse_reference", "registry_location"]

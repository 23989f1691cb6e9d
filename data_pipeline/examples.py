"""The Example contract: per example kind, the fields of `arrays` and `meta` (filled in below)."""

from __future__ import annotations

TOKENS = "tokens"  # one token sequence with per-token target weights (vflash, recipe, chat, vakforge, prepared)
VALEN = "valen"  # token pieces the loader assembles into a state and its scored branches
KINDS = (TOKENS, VALEN)

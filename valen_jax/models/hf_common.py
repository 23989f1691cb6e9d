"""What the Hugging Face importers and exporters share (`hf_text` for decoders, `hf_vl` for Qwen-VL
checkpoints, `hf` the facade over both): the error, the checkpoint resolver (a local directory or a hub
name), dtype names, parameter-tree paths and the rule for added-token rows.

A leaf of `models`: it imports neither importer (nor the model), so both build on it without
importing each other, and the data side can resolve a checkpoint (`vision_processor`) cheaply.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


class HFImportError(ValueError):
    """A checkpoint this importer cannot reproduce exactly (family, activation, windowing...)."""


def resolve(path_or_name: str | Path, revision: str | None = None) -> Path:
    """The checkpoint directory: `path_or_name` itself when it is a local directory, else the snapshot of
    the hub model ORG/NAME at `revision` (a branch, tag or commit; default main), downloaded or found in
    the Hugging Face cache (`HF_HUB_CACHE`; with `HF_HUB_OFFLINE=1` the cache only)."""
    path = Path(path_or_name)
    if path.is_dir():
        if revision is not None:
            raise HFImportError(f"{path}: a local directory has no revisions; revision={revision!r} "
                                "applies to hub names only")
        return path
    name = str(path_or_name)
    if path.exists():
        raise HFImportError(f"{name}: a file, not a checkpoint directory (config.json + *.safetensors) "
                            "or a hub name ORG/NAME")
    from huggingface_hub import constants, snapshot_download  # a hub name: download (or reuse the cache)
    from huggingface_hub.errors import HFValidationError

    at = f" at revision {revision!r}" if revision is not None else ""
    try:
        return Path(snapshot_download(name, revision=revision,
                                      allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.jinja"]))
    except HFValidationError as error:
        raise FileNotFoundError(f"{name!r}: no such local directory, and not a hub model name ORG/NAME "
                                f"({str(error).strip().splitlines()[0]})") from error
    except OSError as error:  # not on the hub or not cached, no such revision, offline, unreachable
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        where = f"it is not in the Hugging Face cache {constants.HF_HUB_CACHE}" + (
            " and HF_HUB_OFFLINE forbids downloading" if constants.is_offline_mode() else " nor available from the hub")
        raise FileNotFoundError(f"model {name!r}{at}: no such local directory, and {where} "
                                f"({type(error).__name__}: {reason})") from error


def dtype_name(dtype) -> str:
    """"bfloat16" for "bfloat16", jnp.bfloat16, np.dtype(ml_dtypes.bfloat16)...: ModelConfig keeps names (JSON)."""
    try:
        return np.dtype(dtype).name
    except TypeError:
        raise HFImportError(f"dtype {dtype!r} is neither a dtype name nor a JAX/NumPy dtype") from None


def get_path(tree, path):
    """The node of a nested dict at `path` (a tuple of keys)."""
    for key in path:
        tree = tree[key]
    return tree


def set_path(tree, path, value):
    """Put `value` at `path` of a nested dict whose parents exist."""
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def extend_rows(table: np.ndarray, rows: int, added_pieces: dict[int, list[int]]) -> np.ndarray:
    """A [rows, D] table: the checkpoint's rows, grown and re-initialised for added tokens.

    The rule (documented, deterministic): an added token's row is the mean of the checkpoint
    rows of the pieces the base tokenizer splits its text into (`<521>` → `<`, `5`, `21`, `>`),
    so a new number token starts near the meaning of its digits instead of at random. This also
    overwrites the untrained spare rows some checkpoints carry (Qwen's table is larger than its
    tokenizer). Rows with no token at all (padding to a multiple of 128) take the mean of the
    checkpoint rows, so their logits sit at the average instead of at an arbitrary value.
    """
    base = table.shape[0]
    if rows < base:
        raise HFImportError(f"model vocabulary {rows} is smaller than the checkpoint's {base}")
    extended = np.empty((rows, table.shape[1]), dtype=table.dtype)
    extended[:base] = table
    extended[base:] = table.astype(np.float32).mean(axis=0).astype(table.dtype)
    for token_id, pieces in added_pieces.items():
        if not 0 <= token_id < rows:
            raise HFImportError(f"added token id {token_id} outside the vocabulary of {rows}")
        if not pieces or max(pieces) >= base:
            raise HFImportError(f"added token id {token_id}: pieces {pieces} are not checkpoint tokens")
        extended[token_id] = table[pieces].astype(np.float32).mean(axis=0).astype(table.dtype)
    return extended


def added_token_pieces(base_tokenizer, tokenizer) -> dict[int, list[int]]:
    """For every token the training tokenizer added, its pieces under the base tokenizer."""
    pieces = {}
    for token_id in range(len(base_tokenizer), len(tokenizer)):
        text = tokenizer.convert_ids_to_tokens(token_id)
        pieces[token_id] = base_tokenizer.encode(text, add_special_tokens=False)
    return pieces

"""A run on prepared token rows is refused before it claims a device (seed 003, "What is checked").

"Before claiming devices, Optimize refuses a run on a prepared dataset when: the rows were prepared
with a tokenizer other than the base model's, at another repository or commit; the longest row is
longer than the run's maxSeqLength; [...] one of the training and validation datasets is prepared
and the other holds chat examples". `check_prepared_run` makes those checks from the descriptors
alone (`prepared.json`, or the copy a shard directory's manifest keeps), so `train` calls it
before anything touches a JAX backend; conversion then reads and checks every row.

- Tokenizer: both digests against the tokenizer as shipped at `config.data.tokenizer` (not the
  training tokenizer, whose added tokens and template would change them, see
  data_pipeline/prepared.py), and the descriptor's repository and commit against the base
  model's: `config.model.init_from`, or the tokenizer for a model trained from scratch. A hub
  name, or a folder inside the Hugging Face cache (`models--ORG--NAME/snapshots/COMMIT`), names
  both. A plain local folder names neither: then only the digests can be compared, and the log says so.
- Length: the longest row against `data.seq_len`; a run never truncates or skips a prepared row.
- Pairing: prepared rows train and validate together; the other set in another format is refused.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from data_pipeline.formats.errors import FormatError
from data_pipeline.formats.prepared import (
    DESCRIPTOR_NAME,
    PreparedDescriptor,
    check_against_tokenizer,
    check_max_seq_length,
    parse_descriptor,
)
from data_pipeline.formats.prepared_load import read_descriptor
from data_pipeline.prepared import UsageError, resolve_source
from data_pipeline.shards import MANIFEST_NAME
from valen_jax.errors import ConfigError

log = logging.getLogger(__name__)

PREPARED = "prepared"


def is_prepared_run(config) -> bool:
    return PREPARED in (config.data.format, config.data.eval_format)


def check_prepared_run(config) -> None:
    """Raise ConfigError naming the set and the rule when a prepared run must be refused."""
    if not is_prepared_run(config):
        return
    formats = {"format": config.data.format, "eval_format": config.data.eval_format}
    if len(set(formats.values())) > 1:
        raise ConfigError(f"config.data.format={formats['format']!r} and config.data.eval_format="
                          f"{formats['eval_format']!r}: a run on prepared rows validates on prepared rows, and a "
                          "run on chat examples on chat examples (seed 003); make both sets prepared, or neither")
    # As shipped (no added tokens, its own template); a missing path is one line naming it.
    from data_pipeline.tokenizer import from_pretrained

    shipped = from_pretrained(config.data.tokenizer)
    base = str(config.model.init_from or config.data.tokenizer)
    identity = base_model_identity(base)
    if identity is None:
        log.warning("%s is a local folder outside the Hugging Face cache: its repository and commit are unknown, "
                    "so prepared rows are checked against its tokenizer digests only", base)
    for key in ("train", "eval"):
        if config.data[key] is None:  # data.eval=None: a run without evaluation
            continue
        descriptor = descriptor_of(config.data[key])
        try:
            check_against_tokenizer(descriptor, shipped, *(identity or (None, None)))
            check_max_seq_length(descriptor, int(config.data.seq_len))
        except FormatError as error:
            raise ConfigError(f"config.data.{key}={config.data[key]}: prepared rows refused before claiming "
                              f"devices (seed 003; base model {base}, data.seq_len={config.data.seq_len}):\n"
                              f"{error}") from None


def base_model_identity(base: str) -> tuple[str, str] | None:
    """(repository, full commit) of a hub name or an HF-cache snapshot folder; None for a plain folder."""
    try:
        return resolve_source(base, None, None)
    except UsageError:
        return None


def descriptor_of(path: str | Path) -> PreparedDescriptor:
    """The descriptor of a prepared zip or folder, or the one a shard directory's manifest recorded."""
    path = Path(path)
    manifest = path / MANIFEST_NAME
    if path.is_dir() and manifest.is_file():
        recorded = json.loads(manifest.read_text(encoding="utf-8")).get(PREPARED)
        if recorded is None:
            raise ConfigError(f"{manifest}: shards without a prepared descriptor; a prepared run needs shards "
                              "converted from a prepared version (or the version itself)")
        return parse_descriptor(json.dumps(recorded).encode(), f"{manifest}:{PREPARED}", str(path))
    try:
        return read_descriptor(path)
    except FormatError as error:
        raise ConfigError(f"{path}: no readable {DESCRIPTOR_NAME}:\n{error}") from None

"""Readers, validators, renderers and shard writers for the seed data formats.

`data_pipeline` never imports `valen_jax`: the training side reads shards through
the schema defined here (`data_pipeline.shards`).
"""

import os

# transformers prints an advisory about missing PyTorch on import; our CLIs promise stderr
# holds exactly one line per data problem, and this stack never needs PyTorch.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

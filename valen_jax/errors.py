"""The user-error taxonomy: errors about a run's input that a command prints as one line.

A `UserError` is the user's to fix and is said in full by its message (a config key, a path, a
workdir's state), so a command's error boundary prints `TypeName: message` instead of a traceback
that would bury it; anything else keeps its traceback. `data_pipeline`'s own errors (paths,
tokenizers, shards, formats) cannot derive from it, since `data_pipeline` never imports
`valen_jax`: a command lists them beside `UserError`.

A leaf: this module imports nothing from `valen_jax` and no heavy library, so every layer (data,
models, the schema, training, the commands) can raise these without importing each other
(tests/test_import_contract.py holds the layers to that).
"""

from __future__ import annotations


class UserError(Exception):
    """An error in what the user gave (config, paths, data, workdir), printed as one line by a command."""


class ConfigError(UserError, ValueError):
    """A config missing a field or holding an impossible value; checked once at start-up."""


class ParamGroupError(UserError, ValueError):
    """A parameter group (config.train.param_groups) that cannot apply: bad regex, no match, contradictory
    settings. The config's start-up check turns the shape errors into a ConfigError."""


class UsageError(UserError, ValueError):
    """A command line that cannot work as written (a flag's value, a config key or variant that does not
    exist, a flag that does not apply to this workdir); a command exits 2 for it, as argparse does."""


class EvaluationError(UserError, ValueError):
    """Data or a workdir that cannot be evaluated, predicted or generated as asked (no examples, a family
    with no evaluation, a checkpoint without the head the data needs); a command exits 1 for it."""


class NothingToTrain(UserError, ValueError):
    """Training data that gives the run's objective nothing to learn (no token with a loss weight, no
    primitive block for a drafter): refused at start-up with the counts found, never trained as loss 0."""

"""The training modes `config.train.mode` can name: each an opener `(Setup, train_set) -> Task`.

    from valen_jax.tasks.modes import register
    register("my_mode", MyTask)       # a Task subclass (or any callable with the same signature)

`ar` (seed 004's default) trains the model itself, its objective chosen by the data: Valen shards
train the scored-branch head (`tasks.valen`), every token format next-token prediction
(`tasks.token_lm`). `vflash` trains VFlash's block drafter against a frozen `ar` target
(`valen_jax.vflash.task`). `reinforce` samples completions and improves the model on their rewards
(`tasks.reinforce`). A mode may also register a preflight `(config) -> None`: its refusals before any
device is claimed (`preflight`, which the loop calls).
"""

from __future__ import annotations

from collections.abc import Callable

from valen_jax.data.valen_rows import is_valen
from valen_jax.errors import ConfigError
from valen_jax.models.build import model_config
from valen_jax.tasks import reinforce
from valen_jax.tasks.token_lm import TokenLMTask
from valen_jax.tasks.valen import ValenTask
from valen_jax.training.task import Setup, Task
from valen_jax.vflash.task import DrafterTask


def _model_task(setup: Setup, train_set) -> Task:
    kind = ValenTask if is_valen(train_set) else TokenLMTask
    return kind(setup, model_config(setup.config, setup.tokenizer), train_set)


MODES: dict[str, Callable[[Setup, object], Task]] = {"ar": _model_task, "vflash": DrafterTask.open,
                                                     reinforce.MODE: reinforce.ReinforceTask.open}
PREFLIGHTS: dict[str, Callable[[object], None]] = {reinforce.MODE: reinforce.preflight}


def register(mode: str, opener: Callable[[Setup, object], Task],
             preflight: Callable[[object], None] | None = None) -> None:
    """Make `config.train.mode=mode` train with `opener(setup, train_set)`, checked first by `preflight(config)`
    when given; a taken name is refused."""
    if mode in MODES:
        raise ValueError(f"train.mode {mode!r} is already registered ({MODES[mode]})")
    MODES[mode] = opener
    if preflight is not None:
        PREFLIGHTS[mode] = preflight


def preflight(config) -> None:
    """The mode's refusals of `config` and its raw data, before any device is claimed (none for most)."""
    check = PREFLIGHTS.get(config.train.mode)
    if check is not None:
        check(config)


def check_mode(config) -> None:
    """Refuse a `config.train.mode` no task is registered for (before the run claims anything)."""
    if config.train.mode not in MODES:
        raise ConfigError(f"config.train.mode={config.train.mode!r}; choose one of {', '.join(MODES)}")


def open_task(setup: Setup, train_set) -> Task:
    """The task of `setup.config.train.mode` for this training data."""
    check_mode(setup.config)
    return MODES[setup.config.train.mode](setup, train_set)

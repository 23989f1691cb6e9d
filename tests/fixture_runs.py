"""Workdirs committed as fixtures (tests/fixtures/), trained in another checkout: evaluated here."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def read_training_data_here(monkeypatch, trained_on: str) -> None:
    """Make evaluation's restores read the fixture's recorded training data (`trained_on`, a path in the
    checkout it was trained in; the report's text-only baseline is fitted on it) from this checkout: the
    same bundled smoke recipe."""
    from valen_jax.evaluation import report as report_module

    restore = report_module.restore_model

    def restore_here(*args, **kwargs):
        restored = restore(*args, **kwargs)
        assert restored.config.data.train == trained_on
        restored.config.data.train = str(ROOT / "data" / "smoke" / "vflash" / "recipe.json")
        return restored

    monkeypatch.setattr(report_module, "restore_model", restore_here)

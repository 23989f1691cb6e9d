"""Per-format rendering: a validated record → an `Example` of token pieces, weights and media."""

from data_pipeline.render.common import RenderError  # noqa: F401

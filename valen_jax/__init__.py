"""valen-jax: train language and vision-language models on Valen, VFlash, chat and vakforge data."""

__version__ = "0.1.0"

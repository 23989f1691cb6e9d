"""Serving trained workdirs over HTTP (`python -m valen_jax.serve`): the slot engine, the request
schemas, errors, incremental detokenisation, image prompts and the FastAPI routes, one module each."""

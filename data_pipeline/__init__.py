"""Readers, validators, renderers and shard writers for the seed data formats.

`data_pipeline` never imports `valen_jax`: the training side reads shards through
the schema defined here (`data_pipeline.shards`).
"""

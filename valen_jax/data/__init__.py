"""Grain input pipeline over `data_pipeline` shards."""

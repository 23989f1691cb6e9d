"""NNX modules with logical axis names: decoder, vision encoder, the combined model."""

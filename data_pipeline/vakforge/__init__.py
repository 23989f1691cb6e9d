"""vakforge's own data tools (seed 002, issue 18): inspect, prepare, synth, split."""

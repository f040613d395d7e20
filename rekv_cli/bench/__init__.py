"""Benchmark runners behind `rekv bench …`; their results are committed under `bench/results/`."""

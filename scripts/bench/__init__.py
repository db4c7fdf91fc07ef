"""Benchmarks and the low-bandwidth lab; each runs as ``python -m scripts.bench.<name>``."""

"""Batch jobs composed from the library: ``python -m pipelines.nightly --root URL``."""

"""Benchmarks: measure codecs, coders, communication and training (figures, not tests)."""

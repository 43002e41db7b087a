"""Benchmarks whose results are written in docs/ with the command that produced them."""

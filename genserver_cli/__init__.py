"""`genserver`: the command-line client of the genserver API (standard library only; imports nothing of the service)."""

__version__ = "1.0.0"

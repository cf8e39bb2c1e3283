"""eaglet: a reproducible build graph from prompt datasets to EAGLE-3 drafters."""

__version__ = "0.1.0"

"""CUDA graph capture engines: monolithic and breakable."""

__version__ = "0.1.0"

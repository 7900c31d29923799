"""Model-level CUDA graph capture and replay."""

__version__ = "0.1.0"

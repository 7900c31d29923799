"""The manager's own error: a strict manager found no graph for a batch."""

from __future__ import annotations


class NoGraphError(RuntimeError):
    """A ``strict`` manager was asked to run a batch that has no captured graph.

    Raised before any static buffer is touched. ``num_tokens`` is the batch's
    real token count and ``reason`` says why it has no graph (above the
    largest capture size, a mixed batch in ``FULL_DECODE_ONLY``, not captured
    yet, ...). A non-strict manager runs such batches eagerly and counts them.
    """

    def __init__(self, num_tokens: int, reason: str) -> None:
        super().__init__(f"strict mode: no CUDA graph for a batch of {num_tokens} tokens: {reason}")
        self.num_tokens = num_tokens
        self.reason = reason

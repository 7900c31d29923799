"""The batch descriptor: the hashable key that names one captured graph."""

from __future__ import annotations

import dataclasses

from ._checks import check_bool, check_int


@dataclasses.dataclass(frozen=True, slots=True)
class BatchDescriptor:
    """Which graph a batch runs: the key of every graph table.

    ``num_tokens`` is the (padded) token count. ``num_reqs`` and ``uniform``
    are set only on keys of graphs that depend on them (FULL graphs, whose
    attention kernels see the request layout); PIECEWISE graphs use the
    relaxed key, which leaves them out. Fields are checked on construction
    (``num_tokens >= 0``, ``num_reqs`` None or >= 1, real bools,
    ``num_active_loras >= 0``; a uniform key names its ``num_reqs`` and its
    tokens split evenly over them, and active adapters need ``has_lora``): a
    wrong key would name a graph that can never exist.

    ``num_active_loras`` is the adapter count a graph was captured for, a
    capacity like the padded ``num_tokens``: a batch replays the graph of the
    smallest captured count that holds its adapters, so the key may name more
    adapters than its tokens or requests (the 1-token graph of the LoRA case
    4 serves a 1-token batch with 1 adapter; vLLM keys every size with every
    LoRA case alike). A step's own count cannot exceed its requests:
    ``dispatch`` and ``RankRequest`` refuse that.

    Args:
        num_tokens: the graph's (padded) token count, at least 0.
        num_reqs: its requests (FULL keys), from 1 to ``num_tokens``;
            ``None`` on a relaxed key.
        uniform: every request has the same tokens (a uniform decode key).
        has_lora: the graph runs LoRA adapters.
        num_active_loras: the adapter count it was captured for.

    Raises:
        ValueError: a field that names a graph which cannot exist, naming it.
    """

    num_tokens: int
    num_reqs: int | None = None
    uniform: bool = False
    has_lora: bool = False
    num_active_loras: int = 0

    def __post_init__(self) -> None:
        # One cheap test of the usual case (dispatch builds a descriptor per
        # eager step); the field-by-field checks below only run to find and
        # name what is wrong. The flags are read as plain objects: callers may
        # not be typed, whatever the annotations promise.
        num_reqs = self.num_reqs
        uniform: object = self.uniform
        has_lora: object = self.has_lora
        if (
            self.num_tokens.__class__ is not int
            or self.num_tokens < 0
            or (
                num_reqs is not None
                and (num_reqs.__class__ is not int or not 1 <= num_reqs <= self.num_tokens)
            )
            or (uniform is not True and uniform is not False)
            or (has_lora is not True and has_lora is not False)
            or self.num_active_loras.__class__ is not int
            or self.num_active_loras < 0
            or (uniform is True and (num_reqs is None or self.num_tokens % num_reqs))
            or (self.num_active_loras and has_lora is not True)
        ):
            self._check_fields()

    def _check_fields(self) -> None:
        """Raise a ``ValueError`` naming the first bad field (int subclasses pass)."""
        check_int("num_tokens", self.num_tokens, minimum=0)
        if self.num_reqs is not None:
            check_int("num_reqs", self.num_reqs, minimum=1)
            if self.num_reqs > self.num_tokens:
                raise ValueError(
                    f"num_reqs: {self.num_reqs} requests for {self.num_tokens} tokens; "
                    "every request has at least one token"
                )
        check_bool("uniform", self.uniform)
        check_bool("has_lora", self.has_lora)
        check_int("num_active_loras", self.num_active_loras, minimum=0)
        if self.uniform and self.num_reqs is None:
            raise ValueError(
                "uniform: a uniform key names its request count (num_reqs), "
                "got uniform=True with num_reqs=None"
            )
        if self.uniform and self.num_reqs is not None and self.num_tokens % self.num_reqs:
            raise ValueError(
                f"uniform: a uniform key's {self.num_tokens} tokens do not split evenly over "
                f"num_reqs={self.num_reqs} requests (every request of a uniform batch has as many)"
            )
        if self.num_active_loras and not self.has_lora:
            raise ValueError(
                f"num_active_loras: {self.num_active_loras} active adapters with has_lora=False; "
                "pass has_lora=True"
            )

    def relaxed(self) -> BatchDescriptor:
        """This key without the request layout, as PIECEWISE graphs are keyed."""
        return BatchDescriptor(
            self.num_tokens,
            has_lora=self.has_lora,
            num_active_loras=self.num_active_loras,
        )

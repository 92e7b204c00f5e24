"""A strategy's options, checked in one place: every wrong value or combination
raises ValueError saying what was expected and what came, before the strategy
touches TensorFlow or the box.

    options = StrategyOptions(mode="async", update="sgd", momentum=0.9)
    options.async_config()   # what the asynchronous engine is given

No dependencies beyond the standard library: every layer may import this module.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Literal, Optional

GradientClipping = Literal["after_sum", "per_worker"]
_GRADIENT_CLIPPING = ("after_sum", "per_worker")


def check_gradient_clipping(value: Any) -> None:
    """Raises ValueError unless `value` is a GradientClipping option."""
    if value not in _GRADIENT_CLIPPING:
        raise ValueError(
            f"gradient_clipping must be 'after_sum' or 'per_worker', got {value!r}")


@dataclasses.dataclass(frozen=True)
class AsyncConfig:
    """How the asynchronous mode updates parameters in the box (SMBStrategy's
    options of that name, checked by StrategyOptions)."""

    staleness: Optional[int] = None  # None: fully asynchronous
    update: str = "delta"            # "delta" (any optimizer) or "sgd" (in the box)
    momentum: float = 0.0            # with update="sgd"
    consistent: bool = True          # False: hogwild reads
    read_at: str = "start"           # "start" of a step, or "push": with the last step's push


@dataclasses.dataclass(frozen=True)
class StrategyOptions:
    """SMBStrategy's options (see its docstring for what each does)."""

    mode: str = "sync"
    staleness: Optional[int] = None
    update: str = "delta"
    momentum: float = 0.0
    consistency: str = "consistent"
    gradient_clipping: str = "after_sum"
    local_replicas: int = 1
    read_at: str = "start"

    def __post_init__(self) -> None:
        if self.mode not in ("sync", "async"):
            raise ValueError(f"mode must be 'sync' or 'async', got {self.mode!r}")
        check_gradient_clipping(self.gradient_clipping)
        if self.consistency not in ("consistent", "hogwild"):
            raise ValueError(
                f"consistency must be 'consistent' or 'hogwild', got {self.consistency!r}")
        if (not isinstance(self.local_replicas, int) or isinstance(self.local_replicas, bool)
                or self.local_replicas < 1):
            raise ValueError(f"local_replicas must be an int >= 1, got {self.local_replicas!r}")
        if self.update not in ("delta", "sgd"):
            raise ValueError(f"update must be 'delta' or 'sgd', got {self.update!r}")
        if self.staleness is not None and (
                not isinstance(self.staleness, int) or isinstance(self.staleness, bool)
                or self.staleness < 0):
            raise ValueError(f"staleness must be None or an int >= 0, got {self.staleness!r}")
        if not isinstance(self.momentum, (int, float)) or not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum!r}")
        if self.read_at not in ("start", "push"):
            raise ValueError(f"read_at must be 'start' or 'push', got {self.read_at!r}")
        if self.mode == "sync" and self.async_config() != AsyncConfig():
            raise ValueError("staleness, update, momentum, consistency and read_at apply to "
                             "mode='async' only")
        if self.momentum and self.update != "sgd":
            raise ValueError(
                f"momentum={self.momentum!r} is the box's momentum step and applies to "
                f"update='sgd' only, got update={self.update!r}: with update='delta' your "
                "Keras optimizer's own momentum applies (e.g. keras.optimizers.SGD("
                "momentum=0.9)); pass momentum=0 here")
        if self.read_at == "push" and (self.staleness is not None or self.local_replicas != 1):
            raise ValueError("read_at='push' needs staleness=None and local_replicas=1: a "
                             "step under a staleness bound reads after the clock's wait, "
                             f"got staleness={self.staleness!r}, "
                             f"local_replicas={self.local_replicas!r}")

    def async_config(self) -> AsyncConfig:
        """The asynchronous engine's part of the options."""
        return AsyncConfig(staleness=self.staleness, update=self.update,
                           momentum=float(self.momentum),
                           consistent=self.consistency == "consistent", read_at=self.read_at)

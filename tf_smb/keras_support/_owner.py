"""Which Keras objects belong to a multi-worker tf_smb strategy.

Every hook in keras_support asks this first and leaves everything else in the
process exactly as Keras made it.
"""
from __future__ import annotations

import weakref
from typing import Any, Iterable, List, Optional, Tuple

from tf_smb import keras_registry as registry

# Async SMB strategies of 2+ workers, for objects that do not record theirs (layers).
_ASYNC_STRATEGIES: "weakref.WeakSet[Any]" = weakref.WeakSet()


def multi_worker_strategy(model: Any) -> Optional[Any]:
    """The tf_smb strategy (SMBStrategy, HorovodStrategy) of 2 or more workers
    (or of an elastic job) that `model` was created under, else None.

    Keras records the strategy in scope when a model is created
    (registry.MODEL_STRATEGY); `model.distribute_strategy` would also
    answer with whatever strategy is in scope at the time of the call, so a
    model built outside any strategy but saved inside `strategy.scope()` would
    wrongly count as one of ours.
    """
    # Imported late: tf_smb.data_parallel imports this package.
    from tf_smb.data_parallel import DataParallelStrategy  # pylint: disable=import-outside-toplevel
    strategy = registry.read(model, registry.MODEL_STRATEGY, None)
    if isinstance(strategy, DataParallelStrategy) and (
            strategy.size > 1 or strategy.elastic_worker is not None):
        return strategy  # an elastic job's: also while it has one member
    return None


def check_built_in_scope(model: Any) -> None:
    """Raises ValueError when `model` was built outside every strategy's scope
    while a tf_smb strategy of 2+ workers exists in this process: training it
    would train this worker alone, on its own data, exchanging nothing."""
    from tf_smb.data_parallel import multi_worker_strategies  # pylint: disable=import-outside-toplevel
    if registry.read(model, registry.MODEL_STRATEGY, None) is not None:
        return  # made in some strategy's scope: that strategy trains it
    strategies = multi_worker_strategies()
    if not strategies:
        return
    strategy = strategies[0]
    raise ValueError(
        f"tf_smb: model {getattr(model, 'name', '?')!r} was built outside "
        f"`strategy.scope()`, but this process is worker {strategy.rank} of a "
        f"{type(strategy).__name__} of {strategy.size} workers: training it would train "
        "this worker alone on its own part of the data, with nothing exchanged and "
        "weights that differ between workers. Build and compile the model inside the "
        "scope:\n    with strategy.scope():\n        model = ...\n        "
        "model.compile(...)\nTo train a model on one worker alone on purpose, build it "
        "in another strategy's scope (e.g. tf.distribute.OneDeviceStrategy('/cpu:0')).")


def broadcast_int(strategy: Any, value: int) -> int:
    """Rank 0's `value`, on every worker of `strategy` (an eager collective:
    every worker must call it, in the same order)."""
    return broadcast_ints(strategy, [value])[0]


def broadcast_ints(strategy: Any, values: List[int], root: int = 0) -> List[int]:
    """Rank `root`'s `values` (as many on every worker), in one eager collective
    (as broadcast_int)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    collectives = strategy.extended._collectives  # pylint: disable=protected-access
    return [int(v) for v in collectives.broadcast(
        [tf.constant(values, tf.int64)], root=root)[0].numpy()]


def sum_ints(strategy: Any, values: List[int]) -> List[int]:
    """The element-wise sums of every worker's `values` (as many on each), eagerly."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    collectives = strategy.extended._collectives  # pylint: disable=protected-access
    return [int(v) for v in collectives.allreduce([tf.constant(values, tf.int64)])[0].numpy()]


def gather_int(strategy: Any, value: int) -> List[int]:
    """Every worker's `value`, by rank (an eager collective, as broadcast_int)."""
    mine = [0] * strategy.size
    mine[strategy.rank] = value
    return sum_ints(strategy, mine)


def sum_int(strategy: Any, value: int) -> int:
    """The sum of every worker's `value` (an eager collective, as broadcast_int)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    collectives = strategy.extended._collectives  # pylint: disable=protected-access
    return int(collectives.allreduce([tf.constant(value, tf.int64)])[0])


def note_async_strategy(strategy: Any) -> None:
    """Remembers an SMBStrategy(mode="async") of 2+ workers (weakly), for
    `async_strategy_holding`."""
    _ASYNC_STRATEGIES.add(strategy)


def async_strategy_holding(variables: Iterable[Any]) -> Optional[Any]:
    """The async strategy whose box holds any of these (placed) tf.Variables."""
    if not _ASYNC_STRATEGIES:  # every layer's set_weights asks: most processes have none
        return None
    refs = [v.ref() for v in variables]
    for strategy in list(_ASYNC_STRATEGIES):
        segments = strategy.extended._box_segments  # pylint: disable=protected-access
        if any(r in segments for r in refs):
            return strategy
    return None


# The two async questions the hooks ask differ: fit asks how to run (clocked
# steps across processes, or one process's replica threads); the weight hooks
# ask where the master copies live (a box shared by 2+ processes).

def async_fit_strategy(model: Any) -> Tuple[Optional[Any], bool]:
    """(the model's SMBStrategy, whether it is one process of local replicas)
    when the model trains asynchronously, else (None, False). Several processes
    take fit's clocked path; one process of local replicas only waits for its
    parameter-server thread at the end."""
    from tf_smb.strategy import SMBStrategy  # pylint: disable=import-outside-toplevel
    strategy = registry.read(model, registry.MODEL_STRATEGY, None)
    if not isinstance(strategy, SMBStrategy) or strategy.mode != "async":
        return None, False
    if strategy.size > 1:
        return strategy, False
    if getattr(strategy.extended, "local_replicas", 1) > 1:
        return strategy, True
    return None, False


def async_box_strategy(model: Any, placed_variables: Iterable[Any]) -> Optional[Any]:
    """The async strategy of 2+ processes whose box holds `model`'s master
    copies: the one it was made under, or (a layer records none) the one whose
    box holds any of `placed_variables` (its trainable variables); else None."""
    strategy = multi_worker_strategy(model)
    if strategy is None:
        return async_strategy_holding(placed_variables)
    return strategy if getattr(strategy, "mode", "sync") == "async" else None

"""What the Keras test workers share: the toy data, the small model, and how a
worker reports its result (one JSON line on stdout, optionally also a file)."""
import json
import os

import numpy as np
import keras


def data(n=96, seed=0):
    """n rows of 6 features and a 3-class label that depends on them."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype(np.float32)
    y = (x[:, :3].sum(1) > x[:, 3:].sum(1)).astype(np.int32) + (x[:, 0] > 1).astype(np.int32)
    return x, y


def build(strategy, lr=0.05):
    """A 6-8-3 MLP with Adam, compiled in the strategy's scope."""
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((6,)),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(3),
        ])
        model.compile(optimizer=keras.optimizers.Adam(lr),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    return model


def report(result, result_dir=None):
    """Prints the result as the last JSON line; also writes rank<r>.json."""
    print(json.dumps(result), flush=True)
    if result_dir:
        with open(os.path.join(result_dir, f"rank{result['rank']}.json"), "w") as f:
            json.dump(result, f)

"""A sync SMBStrategy worker that pauses mid-training so tests/test_sockets.py
can inspect its sockets.

    socket_worker.py DIR [--pause_at N] [--timeout S]

With --plant_listener it also opens a TCP listener and a bound UDP socket
at the pause (the test's proof that its check sees them).

After training batch N of the first epoch (every worker's all-reduces of N+1
steps done) the worker writes DIR/started<rank>.json ({"pid", "rank", "size",
"host"}, through a temporary file and a rename), then waits for DIR/go (exits
with code 3 when it has not appeared within S seconds), trains on to the end
and writes DIR/rank<rank>.json ({"rank", "size", "steps", "weights"}).

Runs under `python -m tf_smb.run -np N` (one node) or mpirun across nodes.
"""
import argparse
import json
import os
import socket
import sys
import time

import numpy as np
import keras

import tf_smb


def _write(path, obj):
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("--pause_at", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--plant_listener", action="store_true",
                        help="for the test's negative control: at the pause, also hold a "
                             "TCP listener on 127.0.0.1 and a UDP socket bound on 0.0.0.0")
    a = parser.parse_args()

    strategy = tf_smb.SMBStrategy()
    rank, size = tf_smb.rank(), tf_smb.size()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64 * size, 6)).astype(np.float32)
    y = (x.sum(1) > 0).astype(np.int32)
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                                  keras.layers.Dense(2)])
        model.compile(optimizer="sgd",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    steps = []
    planted = []

    class Pause(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            steps.append(batch)
            if len(steps) != a.pause_at + 1:
                return
            if a.plant_listener:
                listener = socket.socket()
                listener.bind(("127.0.0.1", 0))
                listener.listen(1)
                udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                udp.bind(("0.0.0.0", 0))
                planted.extend([listener, udp])  # open until the worker ends
            _write(os.path.join(a.dir, f"started{rank}.json"),
                   {"pid": os.getpid(), "rank": rank, "size": size,
                    "host": socket.gethostname()})
            go = os.path.join(a.dir, "go")
            deadline = time.monotonic() + a.timeout
            while not os.path.exists(go):
                if time.monotonic() > deadline:
                    print(f"rank {rank}: {go} did not appear within {a.timeout:.0f}s",
                          file=sys.stderr, flush=True)
                    os._exit(3)  # pylint: disable=protected-access
                time.sleep(0.05)

    model.fit(x, y, batch_size=8 * size, epochs=1, verbose=0, callbacks=[Pause()])
    _write(os.path.join(a.dir, f"rank{rank}.json"),
           {"rank": rank, "size": size, "steps": len(steps),
            "weights": [w.tolist() for w in model.get_weights()]})


if __name__ == "__main__":
    main()

"""keras_digits' data and model under SMBStrategy(mode="async"), with hooks
for tests: slow one rank down, kill one mid-epoch, or (--marker_dir) hold
every rank at the start of epoch --kill_epoch until the test has killed a node
and writes <marker_dir>/go (and again at --rehold_epoch until <marker_dir>/go_on).
Prints a JSON line (and writes it to
<marker_dir>/rank<r>.json and <result_dir>/rank<r>.json)."""
import argparse
import json
import os
import sys
import time
import warnings

os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_digits  # noqa: E402
import tf_smb  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--staleness", type=int, default=None)
    p.add_argument("--update", default="delta")
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--slow_rank", type=int, default=-1)
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--kill_rank", type=int, default=-1)
    p.add_argument("--kill_epoch", type=int, default=1)
    p.add_argument("--marker_dir", default="")
    p.add_argument("--rehold_epoch", type=int, default=-1,
                   help="with --marker_dir: hold again at this epoch until <marker_dir>/go_on")
    p.add_argument("--result_dir", default="",
                   help="also write the JSON line to RESULT_DIR/rank<r>.json")
    p.add_argument("--validate", action="store_true",
                   help="fit with the test set as validation_data (batches of 64)")
    a = p.parse_args()
    keras.utils.set_random_seed(0)
    strategy = tf_smb.SMBStrategy(mode="async", staleness=a.staleness, update=a.update,
                                  momentum=0.9 if a.update == "sgd" else 0.0,
                                  timeout_s=120)
    rank = tf_smb.rank()
    data = keras_digits.load_data(0)
    with strategy.scope():
        sgd = a.update == "sgd"
        model = keras_digits.build_model(0.05 if sgd else 0.003, "sgd" if sgd else "adam")

    def hold(held, go):
        # Says it is held (<held><rank>), then waits for the test's <go>.
        with open(os.path.join(a.marker_dir, f"{held}{rank}"), "w"):
            pass
        deadline = time.time() + 300
        while not os.path.exists(os.path.join(a.marker_dir, go)):
            if time.time() > deadline:
                raise TimeoutError(f"rank {rank}: no {a.marker_dir}/{go} within 300 s")
            time.sleep(0.1)

    class Hooks(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            # Per epoch: the steps Keras announced, the training batches run,
            # and the validation batches run.
            self.announced, self.trained, self.validated = [], [], []

        def on_test_batch_end(self, batch, logs=None):
            if self.validated:
                self.validated[-1] += 1

        def on_train_batch_begin(self, batch, logs=None):
            if rank == a.slow_rank:
                time.sleep(a.delay)

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch
            self.announced.append(self.params["steps"])
            self.trained.append(0)
            self.validated.append(0)
            if a.marker_dir and epoch == a.kill_epoch:
                hold("held", "go")
            if a.marker_dir and epoch == a.rehold_epoch:
                hold("reheld", "go_on")

        def on_train_end(self, logs=None):
            self.own_seconds = time.time() - start  # before waiting for the others

        def on_train_batch_end(self, batch, logs=None):
            self.trained[-1] += 1
            if rank == a.kill_rank and self.epoch == a.kill_epoch and batch == 3:
                os.kill(os.getpid(), 9)

    train = (tf.data.Dataset.from_tensor_slices((data.x_train, data.y_train))
             .shuffle(len(data.x_train), seed=0).batch(64))
    hooks = Hooks()
    start = time.time()
    test = (tf.data.Dataset.from_tensor_slices((data.x_test, data.y_test)).batch(64)
            if a.validate else None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(train, epochs=a.epochs, verbose=0, callbacks=[hooks], validation_data=test)
    res = model.evaluate(data.x_test, data.y_test, batch_size=128, verbose=0,
                         return_dict=True)
    line = json.dumps({"rank": rank, "accuracy": res["accuracy"], "seconds": hooks.own_seconds,
                       "steps": int(strategy.extended.steps.numpy()),
                       "max_gap": int(strategy.extended.max_clock_gap.numpy()),
                       "announced_steps": hooks.announced, "trained_batches": hooks.trained,
                       "validated_batches": hooks.validated,
                       "dataset_batches": [-(-len(data.x_train) // 64), -(-len(data.x_test) // 64)],
                       "warnings": [str(w.message)[:200] for w in caught],
                       "weights_sum": float(sum(float(tf.reduce_sum(w))
                                                for w in model.trainable_variables))})
    print(line, flush=True)
    for folder in {a.marker_dir, a.result_dir} - {""}:
        with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
            f.write(line)


if __name__ == "__main__":
    sys.exit(main())

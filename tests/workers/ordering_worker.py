"""Collectives whose order TensorFlow may change between workers; prints one JSON line.

Scenarios:
  stress   many independent collectives per step (a TF1 session.run and a
           tf.function with a while loop), for --rounds rounds: every sum and
           broadcast is checked against its exact value.
  keras    model.fit with steps_per_execution 1, 4, 7 and with
           gradient_accumulation_steps=2: the final weights of each.
Run with TF_SMB_RANK/TF_SMB_SIZE set (or under mpirun) for N workers (keras
also without, for the one-process reference).
"""
import argparse
import json
import os

import numpy as np

N_INDEPENDENT = 8   # collectives per step with no data dependency between them
LOOP_ITERATIONS = 5


def expected_sum(values_of_rank, size):
    return sum(values_of_rank(r) for r in range(size))


def stress_session(rank, size, runs):
    """TF1-style: independent all-reduces and broadcasts in one session.run."""
    import tensorflow as tf
    import tf_smb
    graph = tf.Graph()
    with graph.as_default():
        tf_smb.init()  # in graph mode: must join now, not add a node that never runs
        feeds = [tf.compat.v1.placeholder(tf.float32, [33]) for _ in range(N_INDEPENDENT)]
        sums = [tf_smb.allreduce([x])[0] for x in feeds]
        roots = [i % size for i in range(N_INDEPENDENT)]
        bcasts = [tf_smb.broadcast([x], root=root)[0] for x, root in zip(feeds, roots)]
    bad = 0
    with tf.compat.v1.Session(graph=graph) as session:
        for run in range(runs):
            def value(i, r):
                return float(i * 1000 + run * 7 + r)
            got = session.run(sums + bcasts,
                              {x: np.full(33, value(i, rank), np.float32)
                               for i, x in enumerate(feeds)})
            for i in range(N_INDEPENDENT):
                want = sum(value(i, r) for r in range(size))
                bad += int(not np.all(got[i] == want))
                bad += int(not np.all(got[N_INDEPENDENT + i] == value(i, roots[i])))
    return bad


def stress_function(rank, size, steps):
    """tf.function: independent collectives in a step and in a while loop body."""
    import tensorflow as tf
    import tf_smb
    tf_smb.init()

    @tf.function
    def step(base):
        outs = []
        for i in range(N_INDEPENDENT):
            # Same shapes, different values: a mix-up changes the sums.
            outs.append(tf_smb.allreduce([tf.fill([17], base + 100.0 * i)])[0])
        outs.append(tf_smb.allreduce([tf.fill([2, 3], tf.cast(base, tf.int16))])[0])

        def body(k, acc):
            a = tf_smb.allreduce([tf.fill([5], base + 10.0 * tf.cast(k, tf.float32))])[0]
            b = tf_smb.allreduce([tf.fill([5], -base - 3.0 * tf.cast(k, tf.float32))])[0]
            return k + 1, acc + a * 1000.0 + b
        _, loop = tf.while_loop(lambda k, acc: k < LOOP_ITERATIONS, body,
                                [tf.constant(0), tf.zeros([5])])
        return outs, loop

    bad = 0
    for s in range(steps):
        def base_of(r):
            return float(s * 13 + r)
        outs, loop = step(tf.constant(base_of(rank)))
        total = sum(base_of(r) for r in range(size))
        for i in range(N_INDEPENDENT):
            bad += int(not np.all(outs[i].numpy() == total + 100.0 * i * size))
        bad += int(not np.all(outs[N_INDEPENDENT].numpy() == int(total)))
        want = sum((total + 10.0 * k * size) * 1000.0 + (-total - 3.0 * k * size)
                   for k in range(LOOP_ITERATIONS))
        bad += int(not np.allclose(loop.numpy(), want, rtol=0, atol=1e-3))
    return bad


def scenario_stress(a):
    from tf_smb import env  # pylint: disable=import-outside-toplevel
    job = env.detect()  # from any launcher (tf_smb.run, mpirun)
    rank, size = job.rank, job.size
    import tensorflow as tf
    rounds = []
    try:
        for _ in range(a.rounds):
            rounds.append({"session_bad": stress_session(rank, size, a.runs),
                           "function_bad": stress_function(rank, size, a.runs)})
    except tf.errors.OpError as e:
        return {"rounds": rounds, "error": f"{type(e).__name__}: {e.message}"}
    return {"rounds": rounds, "error": None}


def scenario_keras(a):
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    import tensorflow as tf
    import keras
    import tf_smb
    strategy = tf_smb.SMBStrategy()
    world = strategy.num_replicas_in_sync
    rng = np.random.default_rng(0)
    # 9 batches of 32: at least steps_per_execution of them (Keras 3.3 fails on fewer).
    x = rng.normal(size=(288, 6)).astype(np.float32)
    y = (x[:, :3].sum(1) > x[:, 3:].sum(1)).astype(np.int32)
    results = {}
    configs = [("spe1", 1, None), ("spe4", 4, None), ("spe7", 7, None), ("accum2", 1, 2)]
    for name, spe, accum in configs:
        keras.utils.set_random_seed(1)
        with strategy.scope():
            model = keras.Sequential([keras.Input((6,)),
                                      keras.layers.Dense(8, activation="tanh"),
                                      keras.layers.Dense(2)])
            kwargs = {"gradient_accumulation_steps": accum} if accum else {}
            model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.5, **kwargs),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          metrics=["accuracy"], steps_per_execution=spe)
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(a.batch * world)
        model.fit(ds, epochs=3, verbose=0)
        results[name] = [w.tolist() for w in model.get_weights()]
    return {"size": world, "weights": results}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("scenario", choices=["stress", "keras"])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--batch", type=int, default=8, help="per-worker batch")
    p.add_argument("--result_dir", default=None,
                   help="also write the result to RESULT_DIR/rank<r>.json")
    a = p.parse_args()
    result = {"stress": scenario_stress, "keras": scenario_keras}[a.scenario](a)
    from tf_smb import env  # pylint: disable=import-outside-toplevel
    result["rank"] = env.detect().rank
    print(json.dumps(result), flush=True)
    if a.result_dir:
        with open(os.path.join(a.result_dir, f"rank{result['rank']}.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()

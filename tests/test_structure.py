"""The layout of tf_smb's strategy code and the pieces that need no second
worker: the collectives interface, box segment names, which variable updates
update="sgd" applies in the box, the error when workers disagree, options of
HorovodStrategy, the import error without TensorFlow, and the docs' length."""
import ast
import glob
import inspect
import os
import re
import subprocess

import pytest

from harness import REPO, base_env, python, run_python




# ---- layout -------------------------------------------------------------------

def test_strategy_module_defines_smb_strategy_alone():
    from tf_smb import strategy
    own = [name for name, obj in vars(strategy).items()
           if inspect.isclass(obj) and obj.__module__ == strategy.__name__]
    assert own == ["SMBStrategy"], own
    # The shared base stays importable from here, as before the split.
    from tf_smb.strategy import DataParallelStrategy
    from tf_smb.data_parallel import DataParallelStrategy as base
    assert DataParallelStrategy is base and issubclass(strategy.SMBStrategy, base)


def test_both_strategies_share_the_neutral_base_and_differ_in_collectives():
    import tf_smb
    from tf_smb import collectives, data_parallel, horovod_strategy
    assert issubclass(tf_smb.SMBStrategy, data_parallel.DataParallelStrategy)
    assert issubclass(tf_smb.HorovodStrategy, data_parallel.DataParallelStrategy)
    assert issubclass(collectives.SMBCollectives, collectives.Collectives)
    assert issubclass(horovod_strategy.HorovodCollectives, collectives.Collectives)
    source = inspect.getsource(horovod_strategy)
    assert "SMBExtended" not in source and "tf_smb.strategy" not in source
    assert not hasattr(data_parallel, "SMBExtended")


def test_collectives_interface_is_abstract():
    from tf_smb.collectives import Collectives

    class NoBarrier(Collectives):
        def allreduce(self, tensors):
            return list(tensors)

        def broadcast(self, tensors, root):
            return list(tensors)

    with pytest.raises(TypeError, match="barrier"):
        NoBarrier()  # pylint: disable=abstract-class-instantiated


def test_allgather_text_over_a_summing_backend():
    """allgather_text relies on allreduce only: simulate 3 workers' sum."""
    import tensorflow as tf
    from tf_smb.collectives import Collectives

    texts = ["'a' float32[2]", "'bb' int64[]", "ünï"]

    class ThreeWorkers(Collectives):
        def __init__(self):
            self.rows = []

        def allreduce(self, tensors):
            self.rows.append(tensors[0])
            return [tensors[0]] if len(self.rows) < 3 else [tf.add_n(self.rows)]

        def broadcast(self, tensors, root):
            raise NotImplementedError

        def barrier(self):
            raise NotImplementedError

    backend = ThreeWorkers()
    got = [backend.allgather_text(t, rank, 3, 64) for rank, t in enumerate(texts)]
    assert got[-1] == texts
    with pytest.raises(ValueError, match="do not fit"):
        backend.allgather_text("x" * 65, 0, 3, 64)


# ---- async mode: segment names, agreement, sgd arguments ------------------------

def test_segment_names_are_paths_kept_short_and_unique():
    from tf_smb.async_mode import MAX_SEGMENT_NAME_BYTES, segment_name
    assert MAX_SEGMENT_NAME_BYTES + len("/velocity") <= 127  # the box's limit
    assert segment_name("sequential/dense/kernel") == "sequential/dense/kernel"
    assert segment_name("dense/kernel", 2) == "dense/kernel#2"
    long_a = "model/" + "block_" * 30 + "conv/kernel"
    long_b = "other/" + "block_" * 30 + "conv/kernel"
    for path in (long_a, long_b, "modèle/" * 40 + "kernel"):
        name = segment_name(path)
        assert len(name.encode("utf-8")) <= MAX_SEGMENT_NAME_BYTES, name
        assert name.endswith("kernel") and name[8] == "~", name
        assert segment_name(path) == name  # the same on every worker
    assert segment_name(long_a) != segment_name(long_b)  # same tail, different hash
    assert segment_name(long_a, 2) != segment_name(long_a)


def test_disagreement_names_every_rank():
    from tf_smb.async_mode import disagreement_message
    assert disagreement_message(0, ["'a' float32[2]"] * 3) is None
    message = disagreement_message(4, ["'a' float32[2]", "'b' float32[2]"])
    assert "#4" in message and "rank 0: 'a' float32[2]" in message
    assert "rank 1: 'b' float32[2]" in message and "same order" in message


def test_sgd_step_arguments():
    import keras
    import tensorflow as tf
    from tf_smb.async_mode import sgd_step_arguments
    grad, lr = tf.ones([2]), tf.constant(0.1)
    assert sgd_step_arguments((grad, lr)) == (grad, lr)       # Keras 3 gradient step
    assert sgd_step_arguments(()) is None                     # weight decay: delta
    assert sgd_step_arguments((tf.Variable([1.0, 2.0]),)) is None    # EMA overwrite
    assert sgd_step_arguments((keras.Variable([1.0, 2.0]),)) is None
    for gradient in (grad, tf.IndexedSlices(grad, tf.constant([0, 1]))):
        with pytest.raises(ValueError, match="gradient alone.*update='delta'"):
            sgd_step_arguments((gradient,))                   # tf_keras: no learning rate


# ---- HorovodStrategy options ----------------------------------------------------

def test_horovod_strategy_checks_gradient_clipping_before_starting_horovod():
    import tf_smb
    with pytest.raises(ValueError, match="gradient_clipping must be 'after_sum' or 'per_worker'"):
        tf_smb.HorovodStrategy(gradient_clipping="before_sum")
    assert "gradient_clipping" in inspect.signature(tf_smb.HorovodStrategy).parameters


def test_horovod_strategy_takes_gradient_clipping():
    p = subprocess.run([*python(), "-c", "import horovod.tensorflow"],
                       capture_output=True, timeout=300, env=base_env())
    assert p.returncode == 0, "tools/test.sh installs Horovod (tools/install_horovod.sh)"
    out = run_python("import tf_smb\n"
                  "for value in ('per_worker', 'after_sum'):\n"
                  "    print(tf_smb.HorovodStrategy(gradient_clipping=value).gradient_clipping)\n"
                  "print(tf_smb.HorovodStrategy().gradient_clipping)\n")
    assert out.split() == ["per_worker", "after_sum", "after_sum"]


# ---- without TensorFlow -----------------------------------------------------------

def test_names_that_need_tensorflow_say_how_to_install_it():
    out = run_python(
        "import sys\n"
        "sys.modules['tensorflow'] = None  # as if not installed\n"
        "import tf_smb\n"
        "print('env', tf_smb.detect().size)\n"
        "for name in ('SMBStrategy', 'HorovodStrategy', 'allreduce'):\n"
        "    try:\n"
        "        getattr(tf_smb, name)\n"
        "    except ImportError as e:\n"
        "        print(type(e).__name__, type(e.__cause__).__name__, '|', e)\n"
        "try:\n"
        "    from tf_smb import SMBStrategy\n"
        "except ImportError as e:\n"
        "    print('from-import', e)\n"
        "try:\n"
        "    tf_smb.NoSuchName\n"
        "except AttributeError as e:\n"
        "    print('attribute', e)\n")
    lines = out.splitlines()
    assert lines[0] == "env 1", out
    for name, line in zip(("SMBStrategy", "HorovodStrategy", "allreduce"), lines[1:4]):
        assert line.startswith("ImportError ModuleNotFoundError |"), line
        assert f"tf_smb.{name} needs TensorFlow" in line, line
        assert "pip install tensorflow (or tensorflow-cpu)" in line, line
    assert lines[4].startswith("from-import tf_smb.SMBStrategy needs TensorFlow"), out
    assert lines[5] == "attribute module 'tf_smb' has no attribute 'NoSuchName'", out


def test_other_missing_modules_are_not_blamed_on_tensorflow():
    """A missing module other than tensorflow keeps its own error."""
    out = run_python(
        "import sys\n"
        "sys.modules['tf_smb.keras_support'] = None\n"
        "import tf_smb\n"
        "try:\n"
        "    tf_smb.SMBStrategy\n"
        "except ModuleNotFoundError as e:\n"
        "    print(e.name)\n")
    assert out.strip() == "tf_smb.keras_support"



# ---- the docs' size budget -------------------------------------------------------

def test_readme_and_examples_stay_within_their_length():
    # The README is for users (history lives in git, benchmark records in docs/),
    # and each example is a script a user copies.
    with open(os.path.join(REPO, "README.md")) as f:
        readme = len(f.readlines())
    assert readme <= 450, f"README.md has {readme} lines, at most 450"
    # Lines a reader can read in a terminal: at most 100 characters outside code blocks
    # (a command there may be longer) and tables of the README and the docs.
    for path in [os.path.join(REPO, "README.md")] + sorted(
            glob.glob(os.path.join(REPO, "docs", "*.md"))):
        long_lines, in_code = [], False
        with open(path) as f:
            for number, line in enumerate(f, 1):
                if line.startswith("```"):
                    in_code = not in_code
                elif not in_code and not line.startswith("|") and len(line.rstrip("\n")) > 100:
                    long_lines.append(number)
        assert not long_lines, (f"{os.path.relpath(path, REPO)}: lines over 100 characters: "
                                f"{long_lines}")
    examples = os.path.join(REPO, "examples")
    for name in sorted(os.listdir(examples)):
        if name.endswith(".py"):
            with open(os.path.join(examples, name)) as f:
                lines = len(f.readlines())
            assert lines <= 250, f"examples/{name} has {lines} lines, at most 250"


# ---- the test tiers (tests/conftest.py) -------------------------------------------

def tier_problems(tests_dir: str, tier_of_file: dict, named: dict) -> list:
    """What is wrong with the tier declarations: a test file in no tier (or a declared
    file that is gone), and a name in a selection list (`named`: list name -> names
    "file" or "file::test" or "file::test[case]") that names no test."""
    files = {f for f in os.listdir(tests_dir) if f.startswith("test_") and f.endswith(".py")}
    problems = [f"{f} is in no tier: add it to TIER_OF_FILE" for f in sorted(files - set(tier_of_file))]
    problems += [f"TIER_OF_FILE names {f}, which is not in tests/" for f in sorted(set(tier_of_file) - files)]
    problems += [f"{f}'s tier is {t!r}, not fast or full" for f, t in tier_of_file.items()
                 if t not in ("fast", "full")]
    for list_name, names in named.items():
        for name in names:
            file, _, test = name.partition("::")
            if file not in files:
                problems.append(f"{list_name}: {name}: no file {file}")
                continue
            if not test:
                continue
            function, _, case = test.partition("[")
            with open(os.path.join(tests_dir, file)) as f:
                source = f.read()
            defined = {node.name for node in ast.walk(ast.parse(source))
                       if isinstance(node, ast.FunctionDef)}
            if function not in defined or (case and case.rstrip("]") not in source):
                problems.append(f"{list_name}: {name} names no test of {file}")
    return problems


def test_every_test_file_has_a_tier_and_every_listed_test_exists():
    import conftest
    tests_dir = os.path.dirname(os.path.abspath(conftest.__file__))
    named = {"FULL_TESTS": conftest.FULL_TESTS, "QUICK": conftest.QUICK,
             "KERAS_FACING": conftest.KERAS_FACING}
    assert tier_problems(tests_dir, conftest.TIER_OF_FILE, named) == []
    # A test moved to --full leaves its file in the fast tier, with a test there
    # that is not moved (a representative of the same proof).
    for name in conftest.FULL_TESTS:
        file = name.split("::")[0]
        assert conftest.TIER_OF_FILE[file] == "fast", f"{name}: its whole file is full already"
        moved = {n.split("::")[1] for n in conftest.FULL_TESTS if n.startswith(file + "::")}
        with open(os.path.join(tests_dir, file)) as f:
            tests = set(re.findall(r"^def (test_\w+)\(", f.read(), flags=re.MULTILINE))
        assert tests - moved, f"every test of {file} is in --full: the fast tier has none"


def test_tier_check_finds_what_it_must(tmp_path):
    (tmp_path / "test_a.py").write_text("import pytest\n\n"
                                        "@pytest.mark.parametrize('x', ['one'])\n"
                                        "def test_one(x):\n    pass\n")
    (tmp_path / "test_b.py").write_text("def test_two():\n    pass\n")
    good = {"L": ["test_a.py::test_one[one]", "test_b.py", "test_b.py::test_two"]}
    assert tier_problems(str(tmp_path), {"test_a.py": "fast", "test_b.py": "full"}, good) == []
    problems = tier_problems(
        str(tmp_path), {"test_a.py": "fast", "test_gone.py": "full"},
        {"L": ["test_a.py::test_one[two]", "test_a.py::test_three", "test_c.py"]})
    assert problems == [
        "test_b.py is in no tier: add it to TIER_OF_FILE",
        "TIER_OF_FILE names test_gone.py, which is not in tests/",
        "L: test_a.py::test_one[two] names no test of test_a.py",
        "L: test_a.py::test_three names no test of test_a.py",
        "L: test_c.py: no file test_c.py"], problems
    assert tier_problems(str(tmp_path), {"test_a.py": "fast", "test_b.py": "nightly"}, {}) == [
        "test_b.py's tier is 'nightly', not fast or full"]

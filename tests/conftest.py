import os
import sys

# Tests import the package from the checkout and the harness beside them.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


import pytest  # noqa: E402


@pytest.fixture(scope="module")
def nodes():
    """Two simulated nodes (tests/simnodes.py) shared by one test module's tests,
    torn down after them; skips only where the kernel refuses namespaces."""
    import simnodes
    sim = simnodes.open_or_skip()
    try:
        yield sim
    finally:
        sim.close()

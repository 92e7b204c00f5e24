"""The core's C++ tests built with ThreadSanitizer and AddressSanitizer (+UB).

cc/tests/collectives_test.cc runs the collectives with ranks as threads of one
process (ThreadGroup), so the sanitizers see every rank; cc/tests/core_test.cc
checks kernels, the box and its segments. Any sanitizer report fails the test.
"""
import pytest

from sanitized import SANITIZERS, build_and_run


@pytest.mark.parametrize("sanitizer", sorted(SANITIZERS))
def test_collectives_with_ranks_as_threads(sanitizer):
    build_and_run("collectives_test", sanitizer)


def test_core_checks_under_address_sanitizer():
    build_and_run("core_test", "address")

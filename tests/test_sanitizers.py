"""The core's C++ tests built with ThreadSanitizer and AddressSanitizer (+UB).

cc/tests/collectives_test.cc runs the collectives with ranks as threads of one
process (ThreadGroup), so the sanitizers see every rank, on one node and across
two (the link between nodes over ThreadNetwork); cc/tests/link_test.cc runs the
link's memory server, clocks, failures and lost nodes the same way;
cc/tests/core_test.cc checks kernels, the box and its segments. Any sanitizer
report fails the test.
"""
import pytest

from sanitized import SANITIZERS, build_and_run


@pytest.mark.parametrize("sanitizer", sorted(SANITIZERS))
def test_collectives_with_ranks_as_threads(sanitizer):
    build_and_run("collectives_test", sanitizer)


@pytest.mark.parametrize("sanitizer", sorted(SANITIZERS))
def test_link_between_nodes_with_ranks_as_threads(sanitizer):
    build_and_run("link_test", sanitizer)


def test_core_checks_under_address_sanitizer():
    build_and_run("core_test", "address")

"""Horovod 0.28.1's test_tensorflow.py at 3 processes (tests/test_horovod_peer.py
says how it runs). A file of its own so that the two long runs of Horovod's
tests go to different pytest-xdist workers."""
from test_horovod_peer import NOT_PASSING_AT_3, check_tensorflow_tests, needs_peer


@needs_peer
def test_horovods_tensorflow_tests_at_3_processes():
    # 75 of 90: also a 2-process-only test, and 7 whose checks fail under Horovod too.
    check_tensorflow_tests(3, NOT_PASSING_AT_3)

"""memcpy: the floor of any exchange of `nbytes`, measured in the driver's own process."""
from __future__ import annotations

import time
from typing import List


def memcpy_times(nbytes: int, repeats: int) -> List[float]:
    """Seconds of `np.copyto` of `nbytes` between two touched buffers, after one warm-up."""
    import numpy as np
    src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    np.copyto(dst, src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return times

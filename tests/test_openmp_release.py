"""kernels.release_openmp_threads ends the OpenMP team kept for the calling thread (a server
calls it once its model is loaded, so that the engine thread's team is the only one and libgomp
keeps spinning at barriers instead of sleeping in the kernel at each of them).

Run in a child process with two OpenMP threads, counting the process's OS threads: a parallel
region leaves one more thread behind, a second region reuses it (the team persists: what a
release that does nothing would leave), and the release ends it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from specdecode.models import kernels

CHILD = """
import os, torch
torch.set_num_threads(2)
from specdecode.models import kernels
def tasks():
    return len(os.listdir("/proc/self/task"))
p = kernels.pack_float(torch.randn(64, 64), torch.float32)
before = tasks()
kernels.matmul(torch.randn(2, 64), p)
first = tasks()
kernels.matmul(torch.randn(2, 64), p)
second = tasks()
released = kernels.release_openmp_threads()
print(before, first, second, tasks(), released)
"""


def test_release_ends_the_calling_threads_openmp_team() -> None:
    if not kernels.available():
        pytest.skip(f"kernels unavailable: {kernels.build_error()}")
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("needs /proc to count threads")
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    before, first, second, after, released = done.stdout.split()
    if released != "True":
        pytest.skip("this OpenMP runtime has no omp_pause_resource_all")
    assert int(first) == int(second) == int(before) + 1  # the team stays between regions
    assert int(after) == int(before)  # and the release ended it

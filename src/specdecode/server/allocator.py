"""Giving freed memory back to the system after the server's big transient allocations.

Tokenizing a long prompt allocates, in the tokenizer's native code, many times the prompt's
size, all freed when it ends. glibc's malloc keeps freed memory in the arena of the thread that
freed it instead of returning it to the system, so a process that once tokenized long prompts
keeps that memory resident: measured (docs/measurements/server-soak.md), the bytes in use stay
flat while the bytes held grow with every thread that tokenized a long prompt. That is
retention, not a leak, and `malloc_trim(0)` releases it. The server calls `trim` on the
long-prompt thread after each long prompt, where its cost (a walk over the free lists) is off
the event loop and the engine thread. Capping glibc's arenas (MALLOC_ARENA_MAX) bounds the
retention of many threads too, but made concurrent tokenizing of short prompts measurably
slower (threads queue on the arena locks), so it is left to the operator's environment.

On a C library without `malloc_trim` (musl, macOS) `trim` does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger("specdecode.server")
T = TypeVar("T")


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library has none."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        func = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    func.argtypes = [ctypes.c_size_t]
    func.restype = ctypes.c_int
    return func  # type: ignore[no-any-return]


def trim() -> bool:
    """Return the allocator's free memory to the system; False where that is not possible."""
    func = _malloc_trim()
    if func is None:
        return False
    try:
        func(0)
    except OSError:  # never let housekeeping fail a request
        log.warning("malloc_trim failed", exc_info=True)
        return False
    return True


def trimming(work: Callable[[], T]) -> Callable[[], T]:
    """`work`, then `trim()` however it ends (a refused prompt allocated as much)."""

    def run() -> T:
        try:
            return work()
        finally:
            trim()

    return run

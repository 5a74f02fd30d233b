"""Process-wide settings a CPU engine makes once it is loaded: what the allocator and the
garbage collector do between steps.

- **The allocator keeps what it frees.** A step's activations are tens of MB (a 4,096-token
  prefill's gate/up output is 50 MB); glibc serves such blocks with fresh ``mmap`` pages and
  trims its heap when they are freed, so every step faults in and zeroes them again (~8 % of a
  prefill's CPU time went to the kernel's page clearing). With ``mmap`` off for the main arena
  and no trimming, freed blocks are reused: the process keeps its peak footprint, as it would
  under tcmalloc or jemalloc (what vLLM's CPU images preload). Threads' arenas still ``mmap``
  what exceeds their heaps.
- **Loaded objects leave the collector's sight.** ``gc.freeze()`` moves everything alive after
  loading (the model's modules, the tokenizer, config) to the permanent generation, so the
  collections that a step's short-lived objects trigger no longer walk them (~2 % of a step).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_MAX = -4


def settle_cpu_process() -> None:
    """Call once the engine is loaded, before it serves: keep freed memory, freeze the heap."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "mallopt"):  # glibc; musl has no mallopt
        libc.mallopt(M_MMAP_MAX, 0)
        libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)
    gc.collect()
    gc.freeze()

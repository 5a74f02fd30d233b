"""What this CPU is, as the products' choices need it: read once from ``/proc/cpuinfo``."""

from __future__ import annotations

import functools


@functools.cache
def _cpuinfo() -> tuple[str, frozenset[str]]:
    """The first CPU's vendor and flags (empty where there is no ``/proc/cpuinfo``)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return "", frozenset()
    vendor = next((ln.split(":")[1].strip() for ln in lines if ln.startswith("vendor_id")), "")
    flags = next((ln.split(":")[1].split() for ln in lines if ln.startswith("flags")), [])
    return vendor, frozenset(flags)


def flags() -> frozenset[str]:
    return _cpuinfo()[1]


@functools.cache
def widens_bfloat16() -> bool:
    """Whether bfloat16's large products and prefill attention run faster as float32 here
    (the operands widened, exactly; the sums in float32 either way): on Intel cores without
    AMX, ``vdpbf16ps`` (32 products) issues on one port where a float32 FMA (16) issues on
    two, and the widening adds work. There oneDNN's bfloat16 products of the default model's
    layers took 1.35-1.75x the time of float32 ones of the widened operands at 128-2,048 rows,
    and prefill attention's dot pairs 1.6x its float32 (two Emerald Rapids cores without
    AMX). AMX's tiles, and AMD's Zen 4 (dot pairs at twice its FMAs' rate), keep bfloat16;
    a CPU without AVX512-BF16 (bfloat16 products emulated) widens too. Asked once: every
    large bfloat16 product asks."""
    return widens(*_cpuinfo())


def widens(vendor: str, flags: frozenset[str]) -> bool:
    """``widens_bfloat16``'s rule for a CPU of this vendor and these flags."""
    if "amx_bf16" in flags:
        return False
    return not (vendor == "AuthenticAMD" and "avx512_bf16" in flags)

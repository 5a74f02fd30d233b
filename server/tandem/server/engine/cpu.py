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
    return not pairs_outrun(vendor, flags)


@functools.cache
def dot_pairs_outrun_fmas() -> bool:
    """Whether bfloat16 dot pairs (``vdpbf16ps``, 32 products) outrun float32 FMAs (16) here,
    so that a decode step's bfloat16 products run as dot pairs rather than widened: on Zen 4
    they issue at the FMAs' rate, twice the products (the default model's decode products at
    16-64 rows: 357-448 GFLOP/s as pairs, 157-214 widened); on Intel's cores on one port where
    FMAs issue on two (an AMX Xeon's, tiles aside: 166-176 as pairs, 207-242 widened;
    ``bench/decode_products.py``)."""
    return pairs_outrun(*_cpuinfo())


def pairs_outrun(vendor: str, flags: frozenset[str]) -> bool:
    """``dot_pairs_outrun_fmas``' rule for a CPU of this vendor and these flags."""
    return vendor == "AuthenticAMD" and "avx512_bf16" in flags

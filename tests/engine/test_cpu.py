"""``cpu``: where bfloat16's large products and prefill attention are widened to float32, and
where a decode step's bfloat16 products run as dot pairs."""

from __future__ import annotations

import pytest

from tandem.server.engine import cpu

AVX512 = frozenset({"avx512f", "avx512bw", "avx512vl"})


@pytest.mark.parametrize(
    "vendor, flags, widened",
    [
        ("GenuineIntel", AVX512 | {"avx512_bf16"}, True),  # Cooper Lake, or AMX not exposed
        ("GenuineIntel", AVX512 | {"avx512_bf16", "amx_bf16", "amx_tile"}, False),  # Sapphire+
        ("GenuineIntel", AVX512, True),  # Ice Lake: bfloat16 products emulated
        ("AuthenticAMD", AVX512 | {"avx512_bf16"}, False),  # Zen 4: dot pairs at twice the FMAs
        ("AuthenticAMD", frozenset({"avx2", "fma"}), True),
        ("", frozenset(), True),  # no /proc/cpuinfo
    ],
)
def test_bfloat16_is_widened_where_its_products_are_slower(
    vendor: str, flags: frozenset[str], widened: bool
) -> None:
    assert cpu.widens(vendor, flags) is widened


@pytest.mark.parametrize(
    "vendor, flags, pairs",
    [
        ("AuthenticAMD", AVX512 | {"avx512_bf16"}, True),  # Zen 4
        ("AuthenticAMD", AVX512, False),
        ("GenuineIntel", AVX512 | {"avx512_bf16"}, False),  # one port for dot pairs
        ("GenuineIntel", AVX512 | {"avx512_bf16", "amx_bf16", "amx_tile"}, False),
        ("", frozenset(), False),
    ],
)
def test_dot_pairs_only_where_they_outrun_fmas(
    vendor: str, flags: frozenset[str], pairs: bool
) -> None:
    assert cpu.pairs_outrun(vendor, flags) is pairs


def test_this_cpu_reads_as_a_vendor_and_flags() -> None:
    assert cpu.widens_bfloat16() is cpu.widens(*cpu._cpuinfo())
    assert cpu.dot_pairs_outrun_fmas() is cpu.pairs_outrun(*cpu._cpuinfo())
    assert isinstance(cpu.flags(), frozenset)

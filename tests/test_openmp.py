"""``tandem.server.openmp``: the engine's OpenMP threads spin briefly before they sleep, unless
the user chose otherwise, and the count is in the environment before torch loads libgomp."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tandem.server.openmp import SPIN_COUNT, default_spin


def test_the_spin_count_is_set_when_the_user_set_none() -> None:
    environ: dict[str, str] = {}
    default_spin(environ)
    assert environ == {"GOMP_SPINCOUNT": SPIN_COUNT}


@pytest.mark.parametrize(
    "given",
    [{"GOMP_SPINCOUNT": "300000"}, {"OMP_WAIT_POLICY": "PASSIVE"}, {"OMP_WAIT_POLICY": "active"}],
)
def test_a_users_choice_wins(given: dict[str, str]) -> None:
    environ = dict(given)
    default_spin(environ)
    assert environ == given


def test_importing_the_server_package_sets_it_before_torch_loads() -> None:
    code = (
        "import os, sys; os.environ.pop('GOMP_SPINCOUNT', None); os.environ.pop('OMP_WAIT_POLICY', None)\n"
        "import tandem.server\n"
        "print(os.environ['GOMP_SPINCOUNT'], 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [SPIN_COUNT, "False"]  # every engine import passes here first

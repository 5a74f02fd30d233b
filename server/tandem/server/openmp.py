"""How long the engine's OpenMP threads spin for work before they sleep, set before torch loads
its OpenMP runtime (``tandem.server`` calls ``default_spin`` as it is imported).

libgomp, the runtime torch bundles and our C kernels share, has a thread that reaches the
end of a parallel region spin for the next one, by default for up to 300,000 pauses, and
reads the count once, when it loads. On cores of its own the spin costs nothing. On cores
other processes share, a spinning thread spends the share of CPU the scheduler would give
its partner, which is still computing: beside two busy processes, a 4,096-token float32
prefill step computed 18 % more CPU seconds than quiet, and got no more than one core's
worth of them. With 30,000 pauses (a tenth of the default: longer than the gaps between a
step's regions, shorter than a timeslice) the same step took 14.9-17.5 s against 17.2-20.5 s
by default, and the bench's float32 ``long-in`` beside two busy processes took 74.0 s
against 83.0 s; quiet bfloat16 runs moved within the machine's spread either way
(docs/performance.md, fifteenth session; 3,000 pauses gained as much under load but cost
quiet decode-heavy runs ~5 %). A user's own ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` wins,
and where torch was imported first the runtime keeps its own.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

SPIN_COUNT = "30000"


def default_spin(environ: MutableMapping[str, str] = os.environ) -> None:
    """Set ``GOMP_SPINCOUNT`` unless the user chose a spin count or wait policy."""
    if "GOMP_SPINCOUNT" not in environ and "OMP_WAIT_POLICY" not in environ:
        environ["GOMP_SPINCOUNT"] = SPIN_COUNT

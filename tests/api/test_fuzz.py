"""Schema fuzzing in CI (issue 16): a short schemathesis run (``bench/fuzz.py``) against a real
engine and a real proxy in front of it, keys set, every operation of both OpenAPI documents
including the admin ones (the instance is thrown away: pause, node removal and terminate
are fuzzed last). Every schemathesis check runs (issue 26): fails on any 5xx, any response
the schema does not describe, a schema-valid request refused or a schema-invalid one
accepted (beyond the statuses ``bench/schemathesis.toml`` names), a method a route lacks not
answered 405, a run error (a connection dropped by a crashing server shows up there), a KV
block still held after the run, or an engine that did not drain and exit cleanly on
``/terminate``.

Bounded in examples per operation and in time per target (about two minutes in all on two
slow cores); ``python bench/fuzz.py --minutes 20`` is the long run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.fuzz import run

pytestmark = pytest.mark.timeout(420)


def test_schemathesis_every_check_passes_and_nothing_leaks(tmp_path: Path) -> None:
    results = run(examples=10, seconds=10, logs=tmp_path)
    targets = {r.target for r in results}
    assert {"engine/admin", "engine/internal", "proxy/admin", "proxy/client"} <= targets
    assert {"kv blocks", "engine /terminate", "engine exit"} <= targets
    assert all(r.test_cases > 0 for r in results if "/" in r.target), [r.line() for r in results]
    failed = [r for r in results if r.failed]
    assert not failed, "\n\n".join(r.line() + "\n" + r.output[-4000:] for r in failed)

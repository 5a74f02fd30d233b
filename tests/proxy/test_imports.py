"""The proxy and the gateway's picker run no model, so importing them (and ``tandem proxy``'s
and ``tandem epp``'s command lines) loads none of the engine: no torch, no transformers, no
numpy, no ZMQ transport, nothing of ``tandem.server.engine``, ``.api`` or ``.disagg``. Checked in a fresh interpreter through
``sys.modules`` (never by timing; ``bench/import_time.py`` measures the time)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

HEAVY = (
    "torch",
    "transformers",
    "numpy",
    "zmq",
    "tandem.server.engine",
    "tandem.server.api",
    "tandem.server.disagg",
)

SCRIPT = """
import json, sys
import tandem.server.proxy.app, tandem.server.proxy.cli
import tandem.server.picker.server, tandem.server.picker.cli, tandem.server.picker.pool
from tandem.server.cli import build_parser
build_parser(only="proxy")  # what `tandem proxy --help` imports
build_parser(only="epp")  # and `tandem epp --help`
print(json.dumps(sorted(sys.modules)))
"""


def test_the_front_doors_and_their_clis_import_nothing_of_the_engine() -> None:
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert r.returncode == 0, r.stderr
    loaded = json.loads(r.stdout.splitlines()[-1])
    heavy = [m for m in loaded if m in HEAVY or m.startswith(tuple(h + "." for h in HEAVY))]
    assert heavy == []
    assert "tandem.server.wire.protocol" in loaded  # the check looked at the right process
    assert "envoy.service.ext_proc.v3.external_processor_pb2" in loaded

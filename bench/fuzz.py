"""Schema fuzzing: schemathesis against a throwaway engine and a proxy in front of it.

Starts ``tandem serve`` (tiny model, keys set) and ``tandem proxy`` on loopback, runs
schemathesis against each one's own OpenAPI document (the admin operations included, with
the admin key; the engine also with the internal key, so the P/D handoff fields are fuzzed
too), and fails on any 5xx, any response its schema does not describe, a 405 without
``Allow``, or a KV block still held after the run. CI runs it briefly
(``tests/test_fuzz.py``); a long run:

    python bench/fuzz.py --minutes 10 --examples 100000

Prints, per target, the requests sent and the failures found.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.api_helpers import ENGINE_FLAGS, ServerProcess, make_model  # noqa: E402
from tests.test_proxy_helpers import ProxyProcess, stop_all  # noqa: E402

CLIENT, INTERNAL, ADMIN = "sk-fuzz-client", "sk-fuzz-internal", "sk-fuzz-admin"
CHECKS = ",".join(
    [
        "not_a_server_error",
        "status_code_conformance",
        "content_type_conformance",
        "response_schema_conformance",
        "allow_header_conformance",
    ]
)
# Operations that would end the run rather than test it: stopping the servers, or holding
# every request until a /resume that may never come.
EXCLUDED = r"^/(terminate|pause|nodes/terminate.*|nodes/remove)$"


@dataclass
class Result:
    target: str
    returncode: int
    requests: int
    failures: int
    output: str

    def line(self) -> str:
        return (
            f"{self.target}: {self.requests} requests, {self.failures} failures, "
            f"exit {self.returncode}"
        )


def schemathesis(
    target: str, url: str, key: str, examples: int, seconds: int, workers: int
) -> Result:
    cmd = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "run",
        f"{url}/openapi.json",
        "--url",
        url,
        "-H",
        f"Authorization: Bearer {key}",
        "--checks",
        CHECKS,
        "--max-examples",
        str(examples),
        "--max-time",
        str(seconds),
        "--workers",
        str(workers),
        "--exclude-path-regex",
        EXCLUDED,
        "--request-timeout",
        "60",
        "--seed",
        "16",
        "--suppress-health-check",
        "all",
        "--no-color",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 300)
    out = proc.stdout + proc.stderr
    return Result(target, proc.returncode, _count(out, "requests"), _failures(out), out)


def _count(out: str, what: str) -> int:
    found = re.findall(r"(\d[\d,]*)\s+" + what, out) or re.findall(r"Test cases:\s*(\d[\d,]*)", out)
    return int(found[-1].replace(",", "")) if found else 0


def _failures(out: str) -> int:
    found = re.findall(r"(\d+) (?:unique )?failures?", out)
    return int(found[-1]) if found else 0


def blocks_held(server: ServerProcess) -> tuple[int, int]:
    """(free, total) KV blocks once the engine is idle and its sessions are gone."""
    httpx.post(server.url + "/wakeup", headers=server.admin_headers, timeout=30)
    server.wait_idle(timeout=120, sessions_ok=True)
    httpx.post(server.url + "/resume", headers=server.admin_headers, timeout=30)
    pool = server.health()["block_pool"]
    return pool["free_blocks"], pool["total_blocks"]


def run(examples: int, seconds: int, workers: int = 2, logs: Path | None = None) -> list[Result]:
    """Engine (admin key, then internal key) and proxy (admin key), each for ``seconds``."""
    logs = logs or Path(tempfile.mkdtemp(prefix="tandem-fuzz-"))
    model = make_model(logs / "model")
    internal = {"TANDEM_INTERNAL_API_KEY": INTERNAL}
    engine = ServerProcess(
        model,
        *ENGINE_FLAGS,
        "--session-ttl",
        "1",
        api_key=CLIENT,
        admin_key=ADMIN,
        env=internal,
        log_path=logs / "engine.log",
    )
    proxy = ProxyProcess(
        "--node",
        engine.url,
        api_key=CLIENT,
        admin_key=ADMIN,
        env=internal,
        log_path=logs / "proxy.log",
    )
    results: list[Result] = []
    try:
        engine.wait_ready()
        proxy.wait_healthy([engine.url])
        for target, url, key in [
            ("engine/admin", engine.url, ADMIN),
            ("engine/internal", engine.url, INTERNAL),
            ("proxy/admin", proxy.url, ADMIN),
            ("proxy/client", proxy.url, CLIENT),
        ]:
            results.append(schemathesis(target, url, key, examples, seconds, workers))
            print(results[-1].line(), flush=True)
        time.sleep(2)  # sessions expire after --session-ttl 1
        free, total = blocks_held(engine)
        leaked = total - free
        results.append(Result("kv blocks", 0 if leaked == 0 else 1, 0, leaked, ""))
        print(f"kv blocks: {free}/{total} free after the run", flush=True)
    finally:
        stop_all([proxy, engine])
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=1.0, help="per target")
    ap.add_argument("--examples", type=int, default=1000, help="per operation")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--logs", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None, help="write the counts here")
    args = ap.parse_args()
    results = run(args.examples, int(args.minutes * 60), args.workers, args.logs)
    for r in results:
        if r.returncode:
            print(r.output[-6000:])
    if args.json:
        args.json.write_text(
            json.dumps([{k: v for k, v in vars(r).items() if k != "output"} for r in results])
        )
    sys.exit(1 if any(r.returncode for r in results) else 0)


if __name__ == "__main__":
    main()

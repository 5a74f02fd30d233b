"""Schema fuzzing: schemathesis against a throwaway engine and a proxy in front of it.

Starts ``tandem serve`` (tiny model, keys set) and ``tandem proxy`` on loopback, runs
schemathesis against each one's own OpenAPI document (the admin operations included, with
the admin key; the engine also with the internal key, so the P/D handoff fields are fuzzed
too), with every check schemathesis has (server errors, responses as documented, 405 with
``Allow`` for a method a route lacks, schema-invalid data refused and schema-valid data
accepted; ``schemathesis.toml`` names the few statuses expected beyond those), and fails on
any failure or a KV block still held after the run. The operations that end a run (pause,
remove or terminate a node, terminate) are fuzzed last, once the block count is taken.
CI runs it briefly (``tests/api/test_fuzz.py``); a long run:

    python bench/fuzz.py --minutes 20 --examples 100000 --only engine/admin

Prints, per target, the test cases sent and the failures found by kind.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.proxy.utils import ProxyProcess, stop_all  # noqa: E402
from tests.utils import ENGINE_FLAGS, ServerProcess, make_model  # noqa: E402

CLIENT, INTERNAL, ADMIN = "sk-fuzz-client", "sk-fuzz-internal", "sk-fuzz-admin"
# Every check schemathesis has (bench/schemathesis.toml says where a status is expected).
CHECKS = "all"
SERVER_ERROR = "ST101"  # not_a_server_error
# Operations that would end the run rather than test it (stopping the servers, or holding
# every request until a /resume): fuzzed on their own at the end.
CONFIG = Path(__file__).with_name("schemathesis.toml")
ENDING = r"^/(terminate|pause|resume|sleep|wakeup|nodes/terminate.*|nodes/remove)$"
TARGETS = ("engine/admin", "engine/internal", "proxy/admin", "proxy/client")


@dataclass
class Result:
    target: str
    returncode: int
    test_cases: int = 0
    server_errors: int = 0  # unique failing cases of not_a_server_error
    violations: int = 0  # unique failing cases of every other check
    errors: list[str] = field(default_factory=list)  # the run could not test something
    output: str = ""

    @property
    def failed(self) -> bool:
        return bool(self.returncode or self.server_errors or self.violations or self.errors)

    def line(self) -> str:
        return (
            f"{self.target}: {self.test_cases} test cases, {self.server_errors} server errors, "
            f"{self.violations} schema violations, {len(self.errors)} run errors "
            f"{self.errors or ''}(exit {self.returncode})"
        )


def schemathesis(
    target: str,
    url: str,
    key: str,
    examples: int,
    seconds: int,
    *,
    include: str | None = None,
    report_dir: Path,
) -> Result:
    """One schemathesis run. One worker: with two, hypothesis's per-thread recursion-limit
    changes race CPython 3.11's ``ast.parse`` ("AST constructor recursion depth mismatch")."""
    part = re.sub(r"\W+", "_", include).strip("_") if include else "main"
    report = report_dir / f"{target.replace('/', '-')}-{part}.json"
    cmd = [
        *(sys.executable, "-m", "schemathesis.cli", "--config-file", str(CONFIG)),
        *("run", f"{url}/openapi.json"),
        *("--url", url, "-H", f"Authorization: Bearer {key}", "--checks", CHECKS),
        *("--max-examples", str(examples), "--max-time", str(seconds), "--workers", "1"),
        *("--request-timeout", "60", "--seed", "16", "--suppress-health-check", "all"),
        *("--no-color", "--report", "json", "--report-json-path", str(report)),
    ]
    cmd += ["--include-path-regex", include] if include else ["--exclude-path-regex", ENDING]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 300)
    out = proc.stdout + proc.stderr
    report.with_suffix(".txt").write_text(out)  # the failures' reproductions, for reading
    if not report.exists():
        return Result(target, proc.returncode or 1, errors=["no report"], output=out)
    doc = json.loads(report.read_text())
    failures = {f["code"]: f["count"] for f in doc["failures"]}
    return Result(
        target,
        proc.returncode,
        test_cases=doc["test_cases"]["generated"],
        server_errors=failures.pop(SERVER_ERROR, 0),
        violations=sum(failures.values()),
        errors=[f"{e['title']} x{e['count']}" for e in doc["errors"]],
        output=out,
    )


def blocks_free(server: ServerProcess) -> tuple[int, int]:
    """(free, total) KV blocks once the engine is idle and its sessions are gone."""
    httpx.post(server.url + "/resume", headers=server.admin_headers, timeout=30)
    httpx.post(server.url + "/wakeup", headers=server.admin_headers, timeout=30)
    server.wait_idle(timeout=120, sessions_ok=True)
    time.sleep(2)  # sessions expire after --session-ttl 1
    pool = server.wait_idle(timeout=120)["block_pool"]
    return pool["free_blocks"], pool["total_blocks"]


def run(
    examples: int,
    seconds: int,
    logs: Path | None = None,
    only: tuple[str, ...] = TARGETS,
    ending: bool = True,
) -> list[Result]:
    """Each target in ``only`` for ``seconds``, then the block count, then (``ending``) the
    operations that stop things: pause/resume, node removal, terminate."""
    logs = logs or Path(tempfile.mkdtemp(prefix="tandem-fuzz-"))
    model = make_model(logs / "model")
    internal = {"TANDEM_INTERNAL_API_KEY": INTERNAL}
    engine = ServerProcess(
        model,
        *ENGINE_FLAGS,
        *("--session-ttl", "1"),
        api_key=CLIENT,
        admin_key=ADMIN,
        env=internal,
        log_path=logs / "engine.log",
    )
    proxy = ProxyProcess(
        *("--node", engine.url),
        api_key=CLIENT,
        admin_key=ADMIN,
        env=internal,
        log_path=logs / "proxy.log",
    )
    urls = {"engine": engine.url, "proxy": proxy.url}
    keys = {"admin": ADMIN, "internal": INTERNAL, "client": CLIENT}
    results: list[Result] = []

    def fuzz(target: str, n: int, secs: int, **kw: str) -> None:
        server, key = target.split("/")
        results.append(
            schemathesis(target, urls[server], keys[key], n, secs, report_dir=logs, **kw)
        )
        print(results[-1].line(), flush=True)

    try:
        engine.wait_ready()
        proxy.wait_healthy([engine.url])
        for target in only:
            fuzz(target, examples, seconds)
        short = min(seconds, 8)
        if ending:
            fuzz("engine/admin", 20, short, include=r"^/(pause|resume|sleep|wakeup)$")
        free, total = blocks_free(engine)  # resumes the engine first
        results.append(Result("kv blocks", int(free != total), violations=total - free))
        print(f"kv blocks: {free}/{total} free after the run", flush=True)
        if ending:
            # the engine ends here: /terminate has no input and answers once, then the engine
            # drains and exits (so it is called, not fuzzed)
            r = httpx.get(engine.url + "/terminate", headers=engine.admin_headers, timeout=30)
            ok = r.status_code == 200 and r.json() == {"status": "terminating"}
            results.append(Result("engine /terminate", int(not ok), test_cases=1))
            engine.proc.wait(timeout=60)
            code = engine.proc.returncode
            results.append(Result("engine exit", code, errors=[] if code == 0 else [str(code)]))
            print(f"engine exit: {code}", flush=True)
            # the proxy's node removal and termination, its engine gone (and terminated again)
            fuzz("proxy/admin", 20, short, include=r"^/nodes/(remove|terminate|terminate_all)$")
    finally:
        stop_all([proxy, engine])
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=1.0, help="per target")
    ap.add_argument("--examples", type=int, default=1000, help="per operation")
    ap.add_argument("--only", nargs="+", choices=TARGETS, default=list(TARGETS))
    ap.add_argument("--no-ending", action="store_true", help="skip pause/remove/terminate")
    ap.add_argument("--logs", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None, help="write the counts here")
    args = ap.parse_args()
    results = run(
        args.examples, int(args.minutes * 60), args.logs, tuple(args.only), not args.no_ending
    )
    for r in results:
        if r.failed:
            print(r.output[-6000:])
    if args.json:
        args.json.write_text(
            json.dumps([{k: v for k, v in vars(r).items() if k != "output"} for r in results])
        )
    sys.exit(1 if any(r.failed for r in results) else 0)


if __name__ == "__main__":
    main()

"""docs/operator.md's condition table names every reason the status code can write."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tandem.operator.status import conditions
from tandem.operator.status.conditions import FAILURES

ROOT = Path(__file__).resolve().parents[2]
STATUS = ROOT / "operator/tandem/operator/status"


def _table_reasons() -> set[str]:
    lines = (ROOT / "docs/operator.md").read_text().splitlines()
    start = lines.index("| condition | status / reason | means | what to do |")
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(line.split("|")[2])  # the status / reason cell
    return {w for row in rows for w in re.findall(r"`([A-Za-z]+)`", row)}


def _written_reasons() -> set[str]:
    """Reasons passed as literals to ``condition(type, ok, REASON, message)`` or as
    ``reason=``, and the reasons the autoscaling reports return."""
    found = set()
    for path in STATUS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "id", None)
            if name == "condition" and len(node.args) > 2:
                arg = node.args[2]
                values = [arg] if isinstance(arg, ast.Constant) else []
                if isinstance(arg, ast.IfExp):
                    values = [arg.body, arg.orelse]
                found |= {v.value for v in values if isinstance(v, ast.Constant)}
            for kw in node.keywords:
                if kw.arg == "reason" and isinstance(kw.value, ast.Constant):
                    found.add(kw.value.value)
    return {r for r in found if isinstance(r, str) and r}


def test_every_reason_written_is_in_the_table() -> None:
    table = _table_reasons()
    assert FAILURES <= table, FAILURES - table
    written = _written_reasons() | {"NotReported", "ScalingActive", "PlannerFailing"}
    written |= {conditions.refusal_reason(m) for m in ("exceeded quota", "PriorityClass", "x")}
    # role-condition "Ready" and the Applied pseudo-condition's reason are not user-facing rows
    missing = written - table - {"Ready"}
    assert not missing, f"add to docs/operator.md's condition table: {sorted(missing)}"

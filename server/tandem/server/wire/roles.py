"""Node roles as LMDeploy's proxy names them: what an engine registers as and the proxy routes by.

An engine joins the proxy with its role as LMDeploy's ``EngineRole`` integer, so an LMDeploy
proxy accepts a Tandem engine too; the proxy also takes the names (and a few aliases).
"""

from __future__ import annotations

from typing import Any

# LMDeploy's EngineRole: Hybrid = 1, Prefill = 2, Decode = 3. "both" is Tandem's hybrid.
ROLE_IDS = {"both": 1, "prefill": 2, "decode": 3}
ROLE_NAMES = {v: k for k, v in ROLE_IDS.items()}
ROLE_ALIASES = {"hybrid": "both", "aggregated": "both", "p": "prefill", "d": "decode"}


def parse_role(value: Any) -> str:
    """A role from LMDeploy's integer enum or a name ("both"/"hybrid", "prefill", "decode")."""
    if value is None:
        return "both"
    if isinstance(value, bool):
        raise ValueError(f"invalid role {value!r}")
    if isinstance(value, int) or (isinstance(value, str) and value.strip().isdigit()):
        try:
            return ROLE_NAMES[int(value)]
        except KeyError:
            raise ValueError(
                f"invalid role {value!r}: the EngineRole values are 1 (hybrid), 2 (prefill), "
                "3 (decode)"
            ) from None
    if isinstance(value, str):
        name = value.strip().lower()
        if name.startswith("enginerole."):
            name = name[len("enginerole.") :]
        name = ROLE_ALIASES.get(name, name)
        if name in ROLE_IDS:
            return name
    raise ValueError(f"invalid role {value!r}: use both (hybrid), prefill or decode")

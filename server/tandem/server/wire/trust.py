"""Authenticating the P/D plane with the internal credential (``docs/security.md``).

Two HMAC-SHA256 keys are derived from the internal secret, one per use:

- the **handle** key signs what a prefill engine hands out (engine id, lease id, block ids,
  token count, transport address, first token, and a digest of the prompt's token ids). A
  decode engine pulls only for a handle whose signature checks against its own prompt, so
  nobody without the secret can name an address to pull from, and blocks computed for
  another prompt can never enter its prefix cache.
- the **node** key answers the proxy's challenge: before the proxy sends a node anything
  carrying the credential, the node must return an HMAC of a fresh nonce under it
  (``node_proof``), so an address an admin registers learns nothing by being polled.
- the **transport** key authenticates each transport request (its kind, body and a fresh
  nonce) and the answer's header (bound to that nonce), so a prefill engine serves only
  peers that hold the secret and a decode engine reads only from one.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import struct
from typing import Any

SIGNATURE_FIELD = "remote_signature"
CHALLENGE_HEADER = "x-tandem-challenge"  # the proxy's nonce, on each /health poll
PROOF_HEADER = "x-tandem-proof"  # the engine's node_proof of it
MAX_NONCE_LEN = 128


def derive_key(secret: str, purpose: str) -> bytes:
    return hmac.new(secret.encode(), f"tandem/{purpose}".encode(), hashlib.sha256).digest()


def prompt_digest(prompt_ids: list[int]) -> str:
    return hashlib.sha256(struct.pack(f"<{len(prompt_ids)}q", *prompt_ids)).hexdigest()


def _handle_message(kv: dict[str, Any], prompt_ids: list[int]) -> bytes:
    fields = [
        str(kv.get("remote_engine_id")),
        str(kv.get("remote_lease_id")),
        [int(b) for b in kv.get("remote_block_ids") or []],
        int(kv.get("remote_num_tokens") or 0),
        str(kv.get("remote_addr")),
        [int(t) for t in kv.get("first_token_ids") or []],
        prompt_digest(prompt_ids),
    ]
    return json.dumps(fields, separators=(",", ":")).encode()


def sign_handle(key: bytes, kv: dict[str, Any], prompt_ids: list[int]) -> dict[str, Any]:
    """The prefill side's handle with its signature added."""
    mac = hmac.new(key, _handle_message(kv, prompt_ids), hashlib.sha256).hexdigest()
    return {**kv, SIGNATURE_FIELD: mac}


def handle_problem(key: bytes, kv: dict[str, Any], prompt_ids: list[int]) -> str | None:
    """Why a decode engine must not pull for this handle, or None when it is genuine."""
    given = kv.get(SIGNATURE_FIELD)
    if not isinstance(given, str):
        return "the remote prefill handle is not signed"
    try:
        expected = hmac.new(key, _handle_message(kv, prompt_ids), hashlib.sha256).hexdigest()
    except (TypeError, ValueError):
        return "the remote prefill handle is malformed"
    if not hmac.compare_digest(given, expected):
        return "the remote prefill handle's signature does not match this prompt"
    return None


def new_nonce() -> str:
    return secrets.token_hex(16)


def request_mac(key: bytes, kind: bytes, body: dict[str, Any]) -> str:
    """A transport request's MAC over its kind and body (the body holds the nonce)."""
    payload = json.dumps({k: v for k, v in body.items() if k != "mac"}, sort_keys=True)
    return hmac.new(key, kind + b"\0" + payload.encode(), hashlib.sha256).hexdigest()


def reply_mac(key: bytes, nonce: str, payload: bytes) -> bytes:
    """The answer's MAC, bound to the request's nonce so it cannot be replayed to another."""
    return hmac.new(key, b"reply\0" + nonce.encode() + b"\0" + payload, hashlib.sha256).digest()


def request_authentic(key: bytes, kind: bytes, body: dict[str, Any]) -> bool:
    given = body.get("mac")
    return (
        isinstance(given, str)
        and isinstance(body.get("nonce"), str)
        and hmac.compare_digest(given, request_mac(key, kind, body))
    )


def node_proof(secret: str, nonce: str) -> str:
    """An engine's answer to the proxy's challenge ``nonce``: proof it holds ``secret``."""
    return hmac.new(derive_key(secret, "node-proof"), nonce.encode(), hashlib.sha256).hexdigest()


def proof_valid(secret: str, nonce: str, given: str | None) -> bool:
    """Whether a node's answer proves it holds ``secret`` (the proxy's side)."""
    return isinstance(given, str) and hmac.compare_digest(given, node_proof(secret, nonce))


# Decode-driven P/D behind a gateway (docs/gateway.md): the picker names the prefill engine a
# decode engine should drive in ``x-prefiller-host-port`` (llm-d's header) and signs it with
# the internal credential, so a client, who never holds it, cannot aim an engine at an address.
PREFILLER_HEADER = "x-prefiller-host-port"
PREFILLER_SIGNATURE_HEADER = "x-tandem-prefiller-signature"
PREFILLER_MAX_AGE_S = 60.0


def prefiller_signature(secret: str, host_port: str, issued_at: float) -> str:
    """``<issued_at>.<hmac>`` over the prefill endpoint and the time the picker named it."""
    stamp = f"{issued_at:.3f}"
    key = derive_key(secret, "prefiller")
    mac = hmac.new(key, f"{host_port}\0{stamp}".encode(), hashlib.sha256).hexdigest()
    return f"{stamp}.{mac}"


def prefiller_valid(secret: str, host_port: str, signature: str | None, now: float) -> bool:
    """Whether the picker (holding ``secret``) named ``host_port`` within the last minute."""
    if not isinstance(signature, str) or "." not in signature:
        return False
    stamp, _, _ = signature.rpartition(".")
    try:
        issued = float(stamp)
    except ValueError:
        return False
    if not -5.0 <= now - issued <= PREFILLER_MAX_AGE_S:
        return False
    return hmac.compare_digest(signature, prefiller_signature(secret, host_port, issued))

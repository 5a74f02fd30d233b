"""The P/D handoff: what a prefill engine returns and what a decode engine is given.

Field names follow vLLM's ``kv_transfer_params`` (``do_remote_decode`` on the way into the
prefill engine, ``do_remote_prefill`` with the ``remote_*`` handle on the way into decode).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .models.config import ModelConfig
from .sampling_params import InvalidParamError


@dataclass(frozen=True)
class KVLayout:
    """What two engines must agree on before blocks can move between them."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str

    def mismatch(self, other: KVLayout) -> str | None:
        diffs = [
            f"{k}: remote {getattr(other, k)} vs local {getattr(self, k)}"
            for k in ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype")
            if getattr(self, k) != getattr(other, k)
        ]
        return "KV layout mismatch (" + "; ".join(diffs) + ")" if diffs else None

    @staticmethod
    def of(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> KVLayout:
        return KVLayout(
            cfg.num_hidden_layers,
            cfg.num_key_value_heads,
            cfg.head_dim,
            block_size,
            str(dtype).removeprefix("torch."),
        )

    def to_dict(self) -> dict[str, Any]:
        return dict(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            block_size=self.block_size,
            dtype=self.dtype,
        )

    @staticmethod
    def from_dict(d: dict[str, Any]) -> KVLayout:
        return KVLayout(
            int(d["num_layers"]),
            int(d["num_kv_heads"]),
            int(d["head_dim"]),
            int(d["block_size"]),
            str(d["dtype"]),
        )


@dataclass(frozen=True)
class RemotePrefill:
    """A decode request's handle on KV blocks a prefill engine holds under a lease."""

    engine_id: str
    block_ids: list[int]
    num_tokens: int
    lease_id: str
    address: str
    first_token_ids: list[int]
    engine_url: str | None = None

    @staticmethod
    def from_params(p: dict[str, Any]) -> RemotePrefill:
        try:
            rp = RemotePrefill(
                engine_id=str(p["remote_engine_id"]),
                block_ids=[int(b) for b in p["remote_block_ids"]],
                num_tokens=int(p["remote_num_tokens"]),
                lease_id=str(p["remote_lease_id"]),
                address=str(p["remote_addr"]),
                first_token_ids=[int(t) for t in p.get("first_token_ids") or []],
                engine_url=p.get("remote_engine_url"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidParamError(
                "kv_transfer_params", f"incomplete remote prefill handle: {exc!r}"
            ) from None
        if len(rp.first_token_ids) != 1:
            raise InvalidParamError(
                "kv_transfer_params", "first_token_ids must hold the prefill's one token"
            )
        return rp


@dataclass(frozen=True)
class PullTask:
    """I/O the engine asks its host to do: copy remote blocks into local ones, then release."""

    request_id: str
    address: str
    lease_id: str
    remote_engine_id: str
    remote_block_ids: list[int]
    local_block_ids: list[int]


def handoff_params(
    engine_id: str,
    block_ids: list[int],
    num_tokens: int,
    lease_id: str,
    address: str | None,
    first_token_ids: list[int],
    lease_seconds: float,
    lora_name: str | None = None,
) -> dict[str, Any]:
    """The handle a prefill hands out; ``lora_name``, the adapter its KV was computed
    through, which the decode request must name too (``KVHandoff.check_lora``), is there
    only for an adapter's prefill."""
    params = {
        "do_remote_prefill": True,
        "remote_engine_id": engine_id,
        "remote_block_ids": block_ids,
        "remote_num_tokens": num_tokens,
        "remote_lease_id": lease_id,
        "remote_addr": address,
        "first_token_ids": first_token_ids,
        "lease_expires_in": lease_seconds,
    }
    return params if lora_name is None else {**params, "lora_name": lora_name}

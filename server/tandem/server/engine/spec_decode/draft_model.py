"""Draft-model proposals: a smaller model sharing the target's vocabulary guesses the next
``k`` tokens greedily, one forward pass per token for all speculating requests at once.

The draft keeps its own paged KV (its own ``ModelRunner`` and block pool, sized like the
target's) for each request, as the tokens whose K/V it holds. Before proposing it compares
them with the request's tokens: the agreeing start stays (the verified part of its last
proposal included), the rest is recomputed, so a rejection rolls the draft back exactly as
``num_computed_tokens`` rolls the target back, and a preempted or session request finds its
draft state still right. A request's draft blocks go back when it ends (``release``); a draft
short of blocks proposes nothing for that request (never evicting another's).

Proposals are verified like any other (``Speculator.verify``): each emitted token is the
target's own draw, so greedy output and the target's distribution stay exact whatever the
draft guesses; a good draft only makes more of them agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ..block_pool import BlockPool
from ..config import ConfigError, EngineConfig
from ..loader import checkpoint_files, read_model_config
from ..model_runner import ModelRunner, StepInputs
from ..models.config import ModelConfig
from ..request import Request


@dataclass(eq=False)
class _Sequence:
    tokens: list[int] = field(default_factory=list)  # whose K/V the draft holds, in order
    block_ids: list[int] = field(default_factory=list)


class DraftModel:
    """The draft model of one engine: ``propose`` for the speculator, ``release`` on finish."""

    def __init__(self, config: EngineConfig, target: ModelConfig, device: torch.device) -> None:
        path = str(config.speculative_model)
        draft = read_model_config(path)
        if draft.vocab_size != target.vocab_size:
            raise ConfigError(
                f"the draft model's vocabulary ({draft.vocab_size}) is not the target's "
                f"({target.vocab_size})"
            )
        cfg = replace(
            config,
            model=path,
            speculative_method=None,
            speculative_model=None,
            enable_lora=False,
            lora_modules=None,
            tensor_parallel_size=1,
        )
        self.runner = ModelRunner(cfg, draft, device)
        # A pass's cost against a one-row step of the target: the weights' bytes each reads.
        self.pass_cost = weights_bytes(path) / weights_bytes(config.model)
        self.block_size = cfg.block_size
        self.pool = BlockPool(self.runner.num_blocks, None)
        self._seqs: dict[str, _Sequence] = {}

    def propose(self, requests: list[Request], lengths: list[int]) -> list[list[int]]:
        """Up to ``lengths[i]`` tokens for each request, greedily; [] where the draft's blocks
        do not stretch that far."""
        live = [
            (i, req) for i, (req, k) in enumerate(zip(requests, lengths)) if k and self._fit(req, k)
        ]
        out: list[list[int]] = [[] for _ in requests]
        feeds = [self._catch_up(req) for _, req in live]
        while live:
            tokens = self._step(
                [self._seqs[req.request_id] for _, req in live],
                [req.num_tokens + len(out[i]) for i, req in live],
                feeds,
            )
            for (i, _), token in zip(live, tokens):
                out[i].append(token)
            kept = [n for n, (i, _) in enumerate(live) if len(out[i]) < lengths[i]]
            live, feeds = [live[n] for n in kept], [[out[live[n][0]][-1]] for n in kept]
        return out

    def release(self, req: Request) -> None:
        """Give back the blocks of a request that ended."""
        seq = self._seqs.pop(req.request_id, None)
        if seq is not None and seq.block_ids:
            self.pool.free(seq.block_ids)

    def _fit(self, req: Request, k: int) -> bool:
        """Blocks for the request's tokens and all but the last of ``k`` proposed ones."""
        seq = self._seqs.setdefault(req.request_id, _Sequence())
        need = -(-(req.num_tokens + k - 1) // self.block_size) - len(seq.block_ids)
        if need > self.pool.num_free:
            return False
        if need > 0:
            seq.block_ids += self.pool.allocate(need)
        return True

    def _catch_up(self, req: Request) -> list[int]:
        """Drop the draft's K/V past where it agrees with the request (at least the request's
        last token is fed again, for its logits); the tokens to feed."""
        seq, ids = self._seqs[req.request_id], req.all_token_ids
        same = 0
        for a, b in zip(seq.tokens, ids[:-1]):
            if a != b:
                break
            same += 1
        del seq.tokens[same:]
        return ids[same:]

    def _step(self, seqs: list[_Sequence], ends: list[int], feeds: list[list[int]]) -> list[int]:
        """One forward pass of the draft: each sequence's ``feeds`` end at position
        ``ends[i] - 1``; the greedy next token of each."""
        bs = self.block_size
        input_ids, positions, slots, logits_rows = [], [], [], []
        for seq, end, feed in zip(seqs, ends, feeds):
            start = end - len(feed)
            input_ids += feed
            positions += range(start, end)
            slots += [seq.block_ids[p // bs] * bs + p % bs for p in range(start, end)]
            logits_rows.append(len(input_ids) - 1)
            seq.tokens += feed
        inputs = StepInputs(
            input_ids,
            positions,
            slots,
            [len(f) for f in feeds],
            list(ends),
            [list(s.block_ids) for s in seqs],
            logits_rows,
        )
        return self.runner.run(inputs).argmax(dim=-1).tolist()


def weights_bytes(model: str) -> int:
    """The bytes of a model's weights as stored (a GGUF file, or an HF folder's safetensors)."""
    path = Path(model)
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in checkpoint_files(path))

"""Prompt lookup (n-gram) proposals: what followed the latest earlier occurrence of the
sequence's last n tokens, for the longest n that occurs.

Editing, summarising, code changes and retrieval answers copy long runs of their prompt (or of
what they wrote already); when the last few tokens occurred before, what came next then is a
good guess for what comes next now, and guessing costs a scan of the tokens, no model.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

# The n-grams tried, longest first: a 1-gram matches almost anywhere (and misses as often);
# longer ones are rarer but their continuations are right far more often.
MIN_NGRAM = 2
MAX_NGRAM = 4


def propose_ngram(
    token_ids: list[int], k: int, min_n: int = MIN_NGRAM, max_n: int = MAX_NGRAM
) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the last ``n`` tokens
    of ``token_ids`` (``n`` from ``max_n`` down to ``min_n``); [] when none occurred before."""
    if k <= 0 or len(token_ids) <= min_n:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        # Windows starting before size - n: every earlier occurrence, never the suffix itself.
        windows = sliding_window_view(tokens[: size - 1], n)
        hits = np.flatnonzero((windows == tokens[size - n :]).all(axis=1))
        if hits.size:
            return _continue(token_ids, int(hits[-1]) + n, k)
    return []


def _continue(token_ids: list[int], start: int, k: int) -> list[int]:
    """``k`` tokens copied from ``start`` on; past the end the copy reads its own output (as
    LZ77 does), so a sequence repeating a period shorter than ``k`` gets a whole proposal."""
    out = token_ids[start : start + k]
    while len(out) < k:
        out.append(out[len(out) - (len(token_ids) - start)])
    return out

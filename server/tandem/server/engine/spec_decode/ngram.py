"""Prompt lookup (n-gram) proposals: what followed the latest earlier occurrence of the
sequence's last n tokens, for the longest n that occurs.

Editing, summarising, code changes and retrieval answers copy long runs of their prompt (or of
what they wrote already); when the last few tokens occurred before, what came next then is a
good guess for what comes next now, and guessing costs a scan of the tokens, no model.
"""

from __future__ import annotations

# The n-grams tried, longest first. Longer ones are rarer but their continuations are right far
# more often; a 1-gram matches almost anywhere and misses as often, but it is what picks a copy
# up again one token after an edit (the default model's ``edit`` bench: 29 steps with 2-grams
# at least, 24 with 1-grams), so a request estimates a 1-gram's acceptance apart (draft.py).
MIN_NGRAM = 1
MAX_NGRAM = 4
STRONG_NGRAM = 2  # a shorter match is a weak proposal


def propose_ngram(
    token_ids: list[int], k: int, min_n: int = MIN_NGRAM, max_n: int = MAX_NGRAM
) -> tuple[list[int], int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the last ``n`` tokens
    of ``token_ids`` (``n`` from ``max_n`` down to ``min_n``), and that ``n``; ([], 0) when
    none occurred before.

    It runs for every decoding request on every step that may propose, mostly to find nothing
    (random text), so it walks only the earlier occurrences of the last token (``list.index``
    finds each in C) and measures how far back each agrees: a few microseconds where numpy's
    sliding windows over the whole sequence took ~0.2 ms a call."""
    size = len(token_ids)
    if k <= 0 or size <= min_n:
        return [], 0
    last, best_n, best_end, end = token_ids[-1], 0, -1, -1
    while True:
        try:  # an occurrence ending before the last token, never the suffix itself
            end = token_ids.index(last, end + 1, size - 1)
        except ValueError:
            break
        n = _agreeing(token_ids, end, max_n)
        if n >= best_n:  # the longest n-gram, and its latest occurrence
            best_n, best_end = n, end
    if best_n < min_n:
        return [], 0
    return _continue(token_ids, best_end + 1, k), best_n


def _agreeing(token_ids: list[int], end: int, most: int) -> int:
    """How many tokens ending at ``end`` equal those ending the sequence (at most ``most``)."""
    tail = len(token_ids) - 1
    n = 1
    while n < most and n <= end and token_ids[end - n] == token_ids[tail - n]:
        n += 1
    return n


def _continue(token_ids: list[int], start: int, k: int) -> list[int]:
    """``k`` tokens copied from ``start`` on; past the end the copy reads its own output (as
    LZ77 does), so a sequence repeating a period shorter than ``k`` gets a whole proposal."""
    out = token_ids[start : start + k]
    while len(out) < k:
        out.append(out[len(out) - (len(token_ids) - start)])
    return out

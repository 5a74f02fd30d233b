"""When a sequence stops: EOS, stop token ids, stop strings (across token boundaries), lengths."""

from __future__ import annotations

from typing import NamedTuple

from .request import Request, RequestStatus


class Stop(NamedTuple):
    """Why a sequence ends: its status, the stop string or token that ended it (None for EOS
    or a length), and where its text is cut when a stop string matched."""

    status: RequestStatus
    reason: str | int | None = None
    text_end: int | None = None


def stop_by_token(req: Request, token: int, max_model_len: int) -> Stop | None:
    p = req.params
    out = len(req.output_token_ids)
    if out >= p.min_tokens:
        if not p.ignore_eos and token in req.sampling.eos_token_ids:
            return Stop(RequestStatus.FINISHED_STOPPED)
        if token in p.stop_token_ids:
            return Stop(RequestStatus.FINISHED_STOPPED, token)
    if out >= req.sampling.max_tokens or req.num_tokens >= max_model_len:
        return Stop(RequestStatus.FINISHED_LENGTH)
    return None


def check_stop(req: Request, token: int, new_text: str, max_model_len: int) -> Stop | None:
    """Whether ``token``, just appended to ``req``, ends it, and why (None: it goes on).

    ``new_text`` is what the token added to the detokenized text (``output_processor.add_text``
    advanced it), searched with the characters before it for a stop string. Pure: the caller
    records the outcome, so the one check serves every path a token arrives by.
    """
    stop = stop_by_token(req, token, max_model_len)
    p = req.params
    if p.stop and new_text and len(req.output_token_ids) >= p.min_tokens:
        found = find_stop_string(req.output.detokenizer.text, len(new_text), p.stop)
        if found is not None:
            idx, string = found
            end = idx + len(string) if p.include_stop_str_in_output else idx
            return Stop(RequestStatus.FINISHED_STOPPED, string, end)
    return stop


def find_stop_string(text: str, num_new_chars: int, stops: list[str]) -> tuple[int, str] | None:
    """The earliest stop string that ends inside the newest characters of ``text``.

    Only the last ``num_new_chars`` plus the longest stop's length are searched, so a stop
    string split across several tokens is found when its last piece arrives.
    """
    best: tuple[int, str] | None = None
    for stop in stops:
        start = max(0, len(text) - num_new_chars - len(stop) + 1)
        idx = text.find(stop, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best


def held_back(stops: list[str]) -> int:
    """Characters a stream must hold back because they may begin a stop string."""
    return max((len(s) for s in stops), default=1) - 1

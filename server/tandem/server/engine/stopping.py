"""When a sequence stops: EOS, stop token ids, stop strings (across token boundaries), lengths."""

from __future__ import annotations

from .request import Request, RequestStatus


def stop_by_token(
    req: Request, token: int, max_model_len: int
) -> tuple[RequestStatus | None, int | None]:
    p = req.params
    out = len(req.output_token_ids)
    if out >= p.min_tokens:
        if not p.ignore_eos and token in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED, None
        if token in p.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, token
    if out >= req.max_tokens or req.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH, None
    return None, None


def check_stop(
    req: Request, token: int, max_model_len: int
) -> tuple[RequestStatus | None, str | int | None]:
    """Whether ``token``, just appended, ends ``req`` (and why); feeds its detokenizer. A
    matched stop string sets ``req.stop_text_end``, where the output text is cut."""
    status, reason = stop_by_token(req, token, max_model_len)
    detok = req.detokenizer
    if detok is None:
        return status, reason
    new_text = detok.add([token])
    stops = req.params.stop
    if stops and new_text and len(req.output_token_ids) >= req.params.min_tokens:
        found = find_stop_string(detok.text, len(new_text), stops)
        if found is not None:
            idx, stop = found
            req.stop_text_end = idx + len(stop) if req.params.include_stop_str_in_output else idx
            return RequestStatus.FINISHED_STOPPED, stop
    return status, reason


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

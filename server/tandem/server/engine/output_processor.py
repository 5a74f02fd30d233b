"""Turning a group of requests into what ``step`` hands back: deltas for a stream (the text,
tokens and logprobs since each choice's last report), else everything so far."""

from __future__ import annotations

from .detokenizer import Tokenizer
from .outputs import CompletionOutput, RequestOutput
from .request import Request
from .stopping import held_back


def group_output(group_id: str, group: list[Request], tokenizer: Tokenizer) -> RequestOutput | None:
    """The group's output: deltas for a streamed request (None when nothing is new), else
    everything so far."""
    finished = all(r.status.finished for r in group)
    if group[0].stream:
        outputs = [c for r in group if (c := _delta(r)) is not None]
        if not outputs:
            return None
    else:
        outputs = [_completion(r, tokenizer) for r in group]
    return RequestOutput(
        request_id=group_id,
        prompt_token_ids=group[0].prompt_token_ids,
        outputs=outputs,
        finished=finished,
        num_cached_tokens=group[0].num_cached_tokens,
        metrics=_timings(group),
        kv_transfer_params=group[0].kv_transfer_params,
        error=group[0].error,
        error_code=group[0].error_code,
        embedding=(group[0].pooled.tolist() if group[0].pooling is not None and finished else None),
    )


def _completion(req: Request, tokenizer: Tokenizer) -> CompletionOutput:
    if req.detokenizer is not None:
        text = req.detokenizer.text[: _text_end(req)]
    else:  # finished, or reported before its end (an n > 1 sibling's finish, an abort)
        text = tokenizer.decode(
            req.output_token_ids, skip_special_tokens=req.params.skip_special_tokens
        )
    return CompletionOutput(
        index=req.index,
        text=text,
        token_ids=list(req.output_token_ids),
        finish_reason=req.finish_reason,
        stop_reason=req.stop_reason,
        logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
    )


def _delta(req: Request) -> CompletionOutput | None:
    """What a streamed choice gained since its last report: reported when its text grows
    or it finishes, so tokens whose text is still held back wait for the next report."""
    end = _text_end(req)
    text = req.detokenizer.text[req.num_reported_chars : end]
    finish = req.status.finished and not req.finish_reported
    if not text and not finish:
        return None
    tokens = req.output_token_ids[req.num_reported_tokens :]
    lps = req.logprobs[req.num_reported_logprobs :]
    req.num_reported_chars = max(end, req.num_reported_chars)
    req.num_reported_tokens += len(tokens)
    req.num_reported_logprobs += len(lps)
    req.finish_reported = req.status.finished
    return CompletionOutput(
        index=req.index,
        text=text,
        token_ids=tokens,
        finish_reason=req.finish_reason,
        stop_reason=req.stop_reason,
        logprobs=lps if req.params.logprobs is not None else None,
    )


def _text_end(req: Request) -> int:
    """How much of the detokenized text may be shown: a stream holds back what may begin
    a stop string."""
    text = req.detokenizer.text
    if req.stop_text_end is not None:
        return req.stop_text_end
    if req.status.finished:
        return len(text)
    return max(0, len(text) - held_back(req.params.stop))


def _timings(group: list[Request]) -> dict[str, float]:
    """Monotonic timestamps of the group: arrival, first token, finish (when known)."""
    lead = group[0]
    out = {"arrival_time": lead.arrival_time}
    firsts = [r.first_token_time for r in group if r.first_token_time is not None]
    if firsts:
        out["first_token_time"] = min(firsts)
    if all(r.finished_time is not None for r in group):
        out["finished_time"] = max(r.finished_time for r in group)
    return out

"""The output path: a sequence's text as its tokens arrive, and a group of requests turned into
what ``step`` hands back: deltas for a stream (the text, tokens and logprobs since each
choice's last report), else everything so far.

``add_text`` is the one place a detokenizer advances (the stop checks read its text, they
do not feed it) and ``finish_text`` the one place it is flushed."""

from __future__ import annotations

from .detokenizer import Tokenizer
from .outputs import CompletionOutput, RequestOutput
from .request import Request
from .stopping import held_back


def add_text(req: Request, token: int) -> str:
    """Detokenize ``token``, just appended to ``req``: the text that became final ("" for a
    sequence without a detokenizer, whose text is decoded once, when it is reported)."""
    detok = req.output.detokenizer
    return "" if detok is None else detok.add([token])


def finish_text(req: Request) -> None:
    """``req`` ended: what its detokenizer still held back is final, unless a stop string
    already cut the text short of it."""
    detok = req.output.detokenizer
    if detok is not None and req.output.stop_text_end is None:
        detok.finish()


def group_output(group_id: str, group: list[Request], tokenizer: Tokenizer) -> RequestOutput | None:
    """The group's output: deltas for a streamed request (None when nothing is new), else
    everything so far."""
    finished = all(r.status.finished for r in group)
    lead = group[0]
    if lead.output.stream:
        outputs = [c for r in group if (c := _delta(r)) is not None]
        if not outputs:
            return None
    else:
        outputs = [_completion(r, tokenizer) for r in group]
    return RequestOutput(
        request_id=group_id,
        prompt_token_ids=lead.prompt_token_ids,
        outputs=outputs,
        finished=finished,
        num_cached_tokens=lead.num_cached_tokens,
        metrics=_timings(group),
        kv_transfer_params=lead.handoff.kv_transfer_params if lead.handoff is not None else None,
        error=lead.output.error,
        error_code=lead.output.error_code,
        embedding=(lead.pooling.vector.tolist() if lead.pooling is not None and finished else None),
        prompt_logprobs=(
            None if lead.output.prompt_logprobs is None else list(lead.output.prompt_logprobs)
        ),
    )


def _completion(req: Request, tokenizer: Tokenizer) -> CompletionOutput:
    out = req.output
    if out.detokenizer is not None:
        text = out.detokenizer.text[: _text_end(req)]
    else:  # finished, or reported before its end (an n > 1 sibling's finish, an abort)
        text = tokenizer.decode(
            req.output_token_ids, skip_special_tokens=req.params.skip_special_tokens
        )
    return CompletionOutput(
        index=out.index,
        text=text,
        token_ids=list(req.output_token_ids),
        finish_reason=req.finish_reason,
        stop_reason=out.stop_reason,
        logprobs=list(out.logprobs) if req.params.logprobs is not None else None,
    )


def _delta(req: Request) -> CompletionOutput | None:
    """What a streamed choice gained since its last report: reported when its text grows
    or it finishes, so tokens whose text is still held back wait for the next report."""
    out = req.output
    end = _text_end(req)
    text = out.detokenizer.text[out.num_reported_chars : end]
    finish = req.status.finished and not out.finish_reported
    if not text and not finish:
        return None
    tokens = req.output_token_ids[out.num_reported_tokens :]
    lps = out.logprobs[out.num_reported_logprobs :]
    out.num_reported_chars = max(end, out.num_reported_chars)
    out.num_reported_tokens += len(tokens)
    out.num_reported_logprobs += len(lps)
    out.finish_reported = req.status.finished
    return CompletionOutput(
        index=out.index,
        text=text,
        token_ids=tokens,
        finish_reason=req.finish_reason,
        stop_reason=out.stop_reason,
        logprobs=lps if req.params.logprobs is not None else None,
    )


def _text_end(req: Request) -> int:
    """How much of the detokenized text may be shown: a stream holds back what may begin
    a stop string."""
    text = req.output.detokenizer.text
    if req.output.stop_text_end is not None:
        return req.output.stop_text_end
    if req.status.finished:
        return len(text)
    return max(0, len(text) - held_back(req.params.stop))


def _timings(group: list[Request]) -> dict[str, float]:
    """Monotonic timestamps of the group: arrival, first token, finish (when known)."""
    out = {"arrival_time": group[0].times.arrival}
    firsts = [r.times.first_token for r in group if r.times.first_token is not None]
    if firsts:
        out["first_token_time"] = min(firsts)
    if all(r.times.finished is not None for r in group):
        out["finished_time"] = max(r.times.finished for r in group)
    return out

"""What ``step`` hands back for a group of sequences, without a model: everything for a
whole request, deltas for a stream (each reported once, text that may begin a stop string
held back), timings merged across the group, the P/D handle and errors carried."""

from __future__ import annotations

from tandem.server.engine.output_processor import finish_text, group_output
from tandem.server.engine.outputs import CompletionOutput
from tandem.server.engine.request import (
    HandoffState,
    OutputState,
    Request,
    RequestStatus,
    TokenLogprob,
)
from tandem.server.engine.sampling_params import SamplingParams
from tandem.server.engine.stopping import check_stop

from .utils import ByteTokenizer, emit, make_request, text_output

TOK = ByteTokenizer()
PROMPT = [1, 2, 3]


def sequence(
    index: int, stream: bool = False, detokenize: bool = True, **params: object
) -> Request:
    """Choice ``index`` of the group "g"; without ``detokenize`` (a whole request with no
    stop strings) its text is decoded only when reported."""
    return make_request(
        PROMPT,
        f"g-{index}",
        index,
        params=SamplingParams(n=2, **params),
        output=text_output(index, stream) if detokenize else OutputState(index=index),
        group_id="g",
    )


def say(req: Request, s: str) -> None:
    for token in TOK.encode(s):
        emit(req, token)


def end(req: Request, status: RequestStatus = RequestStatus.FINISHED_LENGTH) -> None:
    req.status = status
    finish_text(req)


def test_a_whole_group_reports_every_choice_with_everything_so_far() -> None:
    a, b = sequence(0, detokenize=False), sequence(1, detokenize=False)
    a.output_token_ids, b.output_token_ids = TOK.encode("yes"), TOK.encode("no!")
    end(a, RequestStatus.FINISHED_STOPPED)
    end(b)
    out = group_output("g", [a, b], TOK)
    assert out.finished and out.request_id == "g" and out.prompt_token_ids == PROMPT
    assert out.outputs == [
        CompletionOutput(0, "yes", TOK.encode("yes"), "stop"),
        CompletionOutput(1, "no!", TOK.encode("no!"), "length"),
    ]
    assert group_output("g", [a, b], TOK) == out  # asked again: the same, nothing consumed


def test_an_unfinished_whole_group_reports_its_text_so_far() -> None:
    a, b = sequence(0, detokenize=False), sequence(1, detokenize=False)
    a.output_token_ids = TOK.encode("ab")
    end(a)
    b.output_token_ids = TOK.encode("c")
    out = group_output("g", [a, b], TOK)
    assert not out.finished
    assert [(c.text, c.finish_reason) for c in out.outputs] == [("ab", "length"), ("c", None)]


def test_a_whole_request_with_a_stop_string_is_cut_where_it_matched() -> None:
    req = sequence(0, stop=["END"])
    say(req, "okEN")
    token = TOK.encode("D")[0]
    stop = check_stop(req, token, emit(req, token), 1000)
    req.output.stop_reason, req.output.stop_text_end = stop.reason, stop.text_end
    end(req, stop.status)
    (c,) = group_output("g", [req], TOK).outputs
    assert (c.text, c.finish_reason, c.stop_reason) == ("ok", "stop", "END")
    assert c.token_ids == TOK.encode("okEND")


def test_a_stream_reports_each_delta_once_and_nothing_when_nothing_is_new() -> None:
    req = sequence(0, stream=True)
    say(req, "he")
    first = group_output("g", [req], TOK)
    assert first.outputs == [CompletionOutput(0, "he", TOK.encode("he"), None)]
    assert not first.finished
    assert (req.output.num_reported_tokens, req.output.num_reported_chars) == (2, 2)
    assert group_output("g", [req], TOK) is None
    say(req, "llo")
    assert group_output("g", [req], TOK).outputs[0].text == "llo"
    assert req.output.num_reported_tokens == 5


def test_a_stream_reports_its_finish_once() -> None:
    req = sequence(0, stream=True)
    say(req, "hi")
    group_output("g", [req], TOK)
    end(req)
    last = group_output("g", [req], TOK)
    assert last.finished and last.outputs == [CompletionOutput(0, "", [], "length")]
    assert group_output("g", [req], TOK) is None


def test_a_stream_holds_back_text_that_may_begin_a_stop_string() -> None:
    req = sequence(0, stream=True, stop=["END"])
    say(req, "abcEN")
    assert group_output("g", [req], TOK).outputs[0].text == "abc"  # "EN" may become "END"
    say(req, "X")
    delta = group_output("g", [req], TOK).outputs[0]
    assert (delta.text, delta.token_ids) == ("E", TOK.encode("X"))
    end(req)
    assert group_output("g", [req], TOK).outputs[0].text == "NX"  # finished: nothing held


def test_a_stream_that_holds_back_everything_waits_with_its_tokens() -> None:
    req = sequence(0, stream=True, stop=["END"])
    say(req, "EN")
    assert group_output("g", [req], TOK) is None
    say(req, "D")
    req.output.stop_reason, req.output.stop_text_end = "END", 0
    end(req, RequestStatus.FINISHED_STOPPED)
    (delta,) = group_output("g", [req], TOK).outputs
    assert (delta.text, delta.token_ids, delta.stop_reason) == ("", TOK.encode("END"), "END")


def test_a_stream_is_cut_at_the_stop_string() -> None:
    req = sequence(0, stream=True, stop=["!!"])
    say(req, "ok!!")
    req.output.stop_reason, req.output.stop_text_end = "!!", 2
    end(req, RequestStatus.FINISHED_STOPPED)
    assert group_output("g", [req], TOK).outputs[0].text == "ok"


def test_a_streamed_group_reports_only_the_choices_with_something_new() -> None:
    a, b = sequence(0, stream=True), sequence(1, stream=True)
    say(a, "x")
    say(b, "y")
    group_output("g", [a, b], TOK)
    say(b, "z")
    out = group_output("g", [a, b], TOK)
    assert [(c.index, c.text) for c in out.outputs] == [(1, "z")]


def test_stream_logprobs_advance_with_their_own_cursor() -> None:
    req = sequence(0, stream=True, logprobs=0)
    emit(req, ord("a"))  # a decode-side first token: it came without a logprob
    group_output("g", [req], TOK)
    lp = TokenLogprob(ord("b"), -0.5, [])
    emit(req, ord("b"))
    req.output.logprobs.append(lp)
    assert group_output("g", [req], TOK).outputs[0].logprobs == [lp]
    assert req.output.num_reported_logprobs == 1


def test_timings_are_merged_across_the_group() -> None:
    a, b = sequence(0), sequence(1)
    a.times.arrival, b.times.arrival = 1.0, 1.5
    a.times.first_token, b.times.first_token = 3.0, 2.0
    a.times.finished = 5.0
    assert group_output("g", [a, b], TOK).metrics == {
        "arrival_time": 1.0,
        "first_token_time": 2.0,
    }
    b.times.finished = 4.0
    assert group_output("g", [a, b], TOK).metrics["finished_time"] == 5.0


def test_the_p_d_handle_and_an_error_are_carried_from_the_lead() -> None:
    req = make_request(PROMPT, "g")
    req.handoff = HandoffState(remote_decode=True, kv_transfer_params={"remote_lease_id": "L"})
    req.output.error, req.output.error_code = "pull failed", "kv_transfer_error"
    end(req, RequestStatus.FINISHED_ABORTED)
    out = group_output("g", [req], TOK)
    assert out.kv_transfer_params == {"remote_lease_id": "L"}
    assert (out.error, out.error_code, out.finish_reason) == (
        "pull failed",
        "kv_transfer_error",
        "abort",
    )
    assert group_output("g", [make_request(PROMPT, "g")], TOK).kv_transfer_params is None

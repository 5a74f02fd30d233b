"""When a sequence stops, without a model: EOS, stop token ids, stop strings across tokens,
``min_tokens``, the length limits, and that the check only reports (it changes nothing)."""

from __future__ import annotations

import pytest

from tandem.server.engine.request import Request, RequestStatus
from tandem.server.engine.sampling_params import SamplingParams
from tandem.server.engine.stopping import (
    Stop,
    check_stop,
    find_stop_string,
    held_back,
    stop_by_token,
)

from .utils import ByteTokenizer, emit, make_request, text_output

EOS = 256  # a special token: no text
STOPPED, LENGTH = RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH


def request(max_tokens: int = 16, **params: object) -> Request:
    return make_request(
        [1, 2, 3],
        params=SamplingParams(**params),
        max_tokens=max_tokens,
        eos_token_ids=frozenset({EOS}),
        output=text_output(),
    )


def feed(req: Request, tokens: list[int], max_model_len: int = 1000) -> list[Stop | None]:
    """Each token as the engine appends it, and what the stop check says after it."""
    return [check_stop(req, t, emit(req, t), max_model_len) for t in tokens]


def text(s: str) -> list[int]:
    return ByteTokenizer().encode(s)


def test_eos_stops_with_no_stop_reason() -> None:
    assert feed(request(), [*text("ab"), EOS]) == [None, None, Stop(STOPPED)]


def test_ignore_eos_runs_past_eos_until_the_length_limit() -> None:
    req = request(max_tokens=3, ignore_eos=True)
    assert feed(req, [EOS, EOS, EOS]) == [None, None, Stop(LENGTH)]


def test_a_stop_token_id_stops_and_is_the_stop_reason() -> None:
    req = request(stop_token_ids=[ord("!")])
    assert feed(req, text("hi!")) == [None, None, Stop(STOPPED, ord("!"))]


def test_eos_that_is_also_a_stop_token_id_reports_no_reason() -> None:
    assert feed(request(stop_token_ids=[EOS]), [EOS]) == [Stop(STOPPED)]


def test_min_tokens_holds_off_eos_stop_tokens_and_stop_strings() -> None:
    req = request(min_tokens=3, stop=["x"], stop_token_ids=[ord("!")])
    assert feed(req, [EOS, ord("!")]) == [None, None]
    assert feed(request(min_tokens=3, stop=["x"]), text("xx")) == [None, None]
    assert feed(req, [EOS]) == [Stop(STOPPED)]  # the third token may stop


def test_max_tokens_ends_with_length_on_the_last_allowed_token() -> None:
    assert feed(request(max_tokens=3), text("abc")) == [None, None, Stop(LENGTH)]


def test_max_model_len_ends_with_length_when_the_context_is_full() -> None:
    # 3 prompt tokens: the second output token fills a 5-token context
    assert feed(request(), text("ab"), max_model_len=5) == [None, Stop(LENGTH)]


def test_a_stop_string_split_across_tokens_is_found_when_its_last_piece_arrives() -> None:
    req = request(stop=["END"])
    stops = feed(req, text("say END now"))
    assert stops[:6] == [None] * 6
    assert stops[6] == Stop(STOPPED, "END", 4)  # the text is cut before "END"
    assert req.output.detokenizer.text[:4] == "say "


def test_include_stop_str_in_output_cuts_the_text_after_the_stop_string() -> None:
    stops = feed(request(stop=["END"], include_stop_str_in_output=True), text("say END"))
    assert stops[-1] == Stop(STOPPED, "END", 7)


def test_a_multibyte_stop_string_is_found_once_its_character_is_whole() -> None:
    req = request(stop=["é"])
    tokens = text("aé")
    assert len(tokens) == 3  # "é" is two byte tokens
    assert feed(req, tokens) == [None, None, Stop(STOPPED, "é", 1)]


def test_a_stop_string_on_the_last_allowed_token_wins_over_length() -> None:
    assert feed(request(max_tokens=2, stop=["ab"]), text("ab"))[-1] == Stop(STOPPED, "ab", 0)


def observable(req: Request) -> tuple:
    """What the engine and the output path read of a request's end and text."""
    detok = req.output.detokenizer
    out = req.output
    return (
        req.status,
        list(req.output_token_ids),
        detok.text,
        list(detok.token_ids),
        out.stop_reason,
        out.stop_text_end,
    )


def test_check_stop_reports_without_changing_the_request() -> None:
    req = request(stop=["END"], max_tokens=5)
    feed(req, text("xxEN"))
    token = ord("D")
    new_text = emit(req, token)
    before = observable(req)
    first = check_stop(req, token, new_text, 1000)
    assert check_stop(req, token, new_text, 1000) == first == Stop(STOPPED, "END", 2)
    assert observable(req) == before
    assert req.status is RequestStatus.WAITING and req.output.stop_reason is None


def test_stop_by_token_needs_no_text() -> None:
    req = make_request([1], max_tokens=2, eos_token_ids=frozenset({EOS}))
    req.output_token_ids.append(5)
    assert stop_by_token(req, 5, 1000) is None
    req.output_token_ids.append(EOS)
    assert stop_by_token(req, EOS, 1000) == Stop(STOPPED)


def test_find_stop_string_only_searches_the_new_tail() -> None:
    assert find_stop_string("hello wor", 3, ["world"]) is None
    assert find_stop_string("hello world", 2, ["world"]) == (6, "world")
    assert find_stop_string("ab stop cd stop", 4, ["stop"]) == (11, "stop")


def test_find_stop_string_takes_the_earliest_match() -> None:
    assert find_stop_string("xx ab cd", 5, ["cd", "ab"]) == (3, "ab")


@pytest.mark.parametrize(("stops", "n"), [([], 0), (["a"], 0), (["ab", "abcd"], 3)])
def test_a_stream_holds_back_one_less_than_the_longest_stop_string(
    stops: list[str], n: int
) -> None:
    assert held_back(stops) == n

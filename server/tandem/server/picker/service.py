"""The ``ext_proc`` ExternalProcessor the gateway streams each HTTP request through.

In full-duplex streaming the gateway sends the request's headers, then its body in chunks;
the picker buffers the body (the prompt decides the engine), and at its end answers the
headers (the endpoint, ``protocol.routed``) and then the body, unchanged, as the protocol
orders: headers, body, trailers. A bodiless request (``GET /v1/models``) is answered on its
headers. The response's phases are the gateway's choice (its ``processing_mode``; the picker
cannot skip them itself: Envoy ignores ``mode_override`` in full-duplex mode): each is
answered at once, the body passed back chunk by chunk. When the response's headers arrive
the request stops holding the picker's in-flight count; when the exchange ends before (no
response phase configured), it counts until the engine's next scrape (``Picker.release``).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc

from . import protocol
from .choice import Picker, Refusal, Route

log = logging.getLogger("tandem.picker")


class ExternalProcessor(ext_proc_grpc.ExternalProcessorServicer):
    def __init__(self, picker: Picker) -> None:
        self.picker = picker

    async def Process(  # noqa: N802 - the gRPC method's name
        self,
        request_iterator: AsyncIterator[ext_proc.ProcessingRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[ext_proc.ProcessingResponse]:
        exchange = _Exchange(self.picker)
        try:
            async for message in request_iterator:
                for response in exchange.on(message):
                    yield response
                if exchange.refused:
                    return
        finally:
            exchange.close()


class _Exchange:
    """One HTTP request's ext_proc stream: what arrived so far and what was answered."""

    def __init__(self, picker: Picker) -> None:
        self.picker = picker
        self.path = "/"
        self.caller = ""
        self.subset: frozenset[str] | None = None
        self.body = bytearray()
        self.route: Route | None = None
        self.refused = False

    def on(self, message: ext_proc.ProcessingRequest) -> list[ext_proc.ProcessingResponse]:
        which = message.WhichOneof("request")
        if which == "request_headers":
            headers = protocol.header_map(message.request_headers)
            self.path = headers.get(":path", "/")
            self.caller = headers.get("authorization", headers.get("x-api-key", ""))
            self.subset = protocol.subset_hint(message)
            if message.request_headers.end_of_stream:
                return self._decide(None)
            return []
        if which == "request_body":
            self.body += message.request_body.body
            if message.request_body.end_of_stream:
                return self._decide(len(self.body)) + self._body(True)
            return []
        if which == "request_trailers":
            decided = [] if self.route else self._decide(len(self.body)) + self._body(False)
            return decided + [protocol.trailers_passed()]
        return self._on_response(message, which)

    def _on_response(
        self, message: ext_proc.ProcessingRequest, which: str | None
    ) -> list[ext_proc.ProcessingResponse]:
        """The response's phases, for gateways that send them: the headers tell how the
        engine answered (and end the request's hold on the picker's in-flight count); the
        body (full duplex, as GIE's reference gateways stream it) and trailers pass as
        they are, chunk by chunk, so a streamed answer is not held back."""
        if which == "response_headers":
            status = protocol.header_map(message.response_headers).get(":status", "")
            if self.route is not None and status.isdigit():
                served = protocol.served_endpoint(message)
                self.picker.answered(self.route, int(status), served)
            self.close(answered=True)
            return [protocol.response_headers_passed()]
        if which == "response_body":
            chunk = message.response_body
            return [protocol.body_passed(chunk.body, chunk.end_of_stream, "response_body")]
        if which == "response_trailers":
            return [protocol.trailers_passed("response_trailers")]
        return []

    def _decide(self, body_length: int | None) -> list[ext_proc.ProcessingResponse]:
        outcome = self.picker.choose(self.path, bytes(self.body), self.subset, self.caller)
        if isinstance(outcome, Refusal):
            self.refused = True
            log.info("refused %s: %d %s", self.path, outcome.status, outcome.code)
            return [
                protocol.refused(outcome.status, outcome.message, outcome.code, outcome.retry_after)
            ]
        self.route = outcome
        return [protocol.routed(outcome.endpoints, body_length, outcome.prefiller)]

    def _body(self, end_of_stream: bool) -> list[ext_proc.ProcessingResponse]:
        if self.refused:
            return []
        body, self.body = bytes(self.body), bytearray()
        return [protocol.body_passed(body, end_of_stream)]

    def close(self, answered: bool = False) -> None:
        """The request no longer holds the in-flight count (``Picker.release``); once."""
        if self.route is not None:
            log.debug("request to %s ended", self.route.endpoint)
            self.picker.release(self.route, answered)
            self.route = None

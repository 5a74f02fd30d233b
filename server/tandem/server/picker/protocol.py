"""The endpoint picker protocol's vocabulary (Gateway API Inference Extension, proposal 004)
in Envoy's ``ext_proc`` messages, from the official generated protos (``xds-protos``).

The picker reads the request's headers and body and the gateway's subset hint; it answers
with the chosen endpoint twice, as the ``x-gateway-destination-endpoint`` header (which an
``ORIGINAL_DST`` cluster reads) and as ``dynamic_metadata["envoy.lb"]`` (for gateways that
route by metadata), with the same value, or with an immediate 503 (no endpoint ready), 429
(shed) or 404 (no such model), each with an OpenAI-shaped error body.
"""

from __future__ import annotations

import json

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from tandem.server.wire.errors import error_body
from tandem.server.wire.trust import PREFILLER_HEADER, PREFILLER_SIGNATURE_HEADER

DESTINATION_HEADER = "x-gateway-destination-endpoint"
DESTINATION_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVED_KEY = "x-gateway-destination-endpoint-served"
# Headers only the picker may set: a client's copy is overwritten or removed on every request.
PICKER_HEADERS = (DESTINATION_HEADER, PREFILLER_HEADER, PREFILLER_SIGNATURE_HEADER)
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def header_map(message: ext_proc.HttpHeaders) -> dict[str, str]:
    """A message's headers, lower-cased names (Envoy sends ``raw_value`` bytes)."""
    return {
        h.key.lower(): (h.raw_value.decode("latin-1") if h.raw_value else h.value)
        for h in message.headers.headers
    }


def subset_hint(request: ext_proc.ProcessingRequest) -> frozenset[str] | None:
    """The endpoints the gateway allows for this request, or None when it gives no hint."""
    namespace = request.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if namespace is None or SUBSET_KEY not in namespace.fields:
        return None
    value = namespace.fields[SUBSET_KEY]
    if value.HasField("list_value"):
        return frozenset(v.string_value for v in value.list_value.values if v.string_value)
    return frozenset(e.strip() for e in value.string_value.split(",") if e.strip())


def served_endpoint(request: ext_proc.ProcessingRequest) -> str | None:
    """The endpoint the gateway says served the response
    (``metadata_context.filter_metadata["envoy.lb"]["x-gateway-destination-endpoint-served"]``),
    or None when it does not say."""
    namespace = request.metadata_context.filter_metadata.get(DESTINATION_NAMESPACE)
    if namespace is None or SERVED_KEY not in namespace.fields:
        return None
    return namespace.fields[SERVED_KEY].string_value or None


def routed(
    endpoint: str, body_length: int | None, prefiller: tuple[str, str] | None = None
) -> ext_proc.ProcessingResponse:
    """The answer to the request's headers: the endpoint (``ip:port``, or a list
    ``ip:port,ip:port`` best first for a gateway that falls back) in the header and the
    metadata (one value), the route cache cleared so the gateway routes on it, and the P/D headers set
    (``prefiller``: the prefill endpoint and its signature) or removed."""
    sets = {DESTINATION_HEADER: endpoint}
    if body_length is not None:
        sets["content-length"] = str(body_length)
    removes = []
    if prefiller is None:
        removes = [PREFILLER_HEADER, PREFILLER_SIGNATURE_HEADER]
    else:
        sets[PREFILLER_HEADER], sets[PREFILLER_SIGNATURE_HEADER] = prefiller
    mutation = ext_proc.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=k, raw_value=v.encode()), append_action=_OVERWRITE
            )
            for k, v in sets.items()
        ],
        remove_headers=removes,
    )
    metadata = struct_pb2.Struct()
    metadata.update({DESTINATION_NAMESPACE: {DESTINATION_HEADER: endpoint}})
    return ext_proc.ProcessingResponse(
        request_headers=ext_proc.HeadersResponse(
            response=ext_proc.CommonResponse(header_mutation=mutation, clear_route_cache=True)
        ),
        dynamic_metadata=metadata,
    )


def body_passed(
    body: bytes, end_of_stream: bool = True, phase: str = "request_body"
) -> ext_proc.ProcessingResponse:
    """In full-duplex streaming the picker hands each body chunk back to the gateway,
    unchanged: the request's (``phase`` ``request_body``) and, when the gateway streams the
    response through the picker too as GIE's reference gateways do, the response's
    (``response_body``)."""
    streamed = ext_proc.StreamedBodyResponse(body=body, end_of_stream=end_of_stream)
    mutation = ext_proc.BodyMutation(streamed_response=streamed)
    return ext_proc.ProcessingResponse(
        **{phase: ext_proc.BodyResponse(response=ext_proc.CommonResponse(body_mutation=mutation))}
    )


def trailers_passed(phase: str = "request_trailers") -> ext_proc.ProcessingResponse:
    """Trailers (``request_trailers`` or ``response_trailers``) pass unchanged."""
    return ext_proc.ProcessingResponse(**{phase: ext_proc.TrailersResponse()})


def response_headers_passed() -> ext_proc.ProcessingResponse:
    return ext_proc.ProcessingResponse(response_headers=ext_proc.HeadersResponse())


def refused(
    status: int, message: str, code: str, retry_after: int | None = None
) -> ext_proc.ProcessingResponse:
    """The gateway answers the client itself, in the engines' (OpenAI's) error shape."""
    headers = [
        base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key="content-type", raw_value=b"application/json")
        )
    ]
    if retry_after is not None:
        headers.append(
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key="retry-after", raw_value=str(retry_after).encode())
            )
        )
    return ext_proc.ProcessingResponse(
        immediate_response=ext_proc.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=ext_proc.HeaderMutation(set_headers=headers),
            body=json.dumps(error_body(status, message, code=code)).encode(),
            details=code,
        )
    )

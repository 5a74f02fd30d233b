"""``tandem epp``: Tandem's routing as a Gateway API Inference Extension endpoint picker.

A gateway (Envoy and the gateways built on it) asks the picker over Envoy's ``ext_proc`` gRPC
protocol where each request goes; the picker answers with the engine's ``ip:port`` and, for
prefill -> decode, the prefill engine the decode engine should drive. It scores with the
proxy's own routing (``tandem.server.proxy.routing``) over the proxy's registry: one scorer,
two front doors. Like the proxy it imports nothing of the engine (``docs/gateway.md``).
"""

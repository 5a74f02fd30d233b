"""Prefill/decode disaggregation, the I/O half: the KV transport and the decode side's puller.

The bookkeeping (leases, pulls, the handoff parameters) is the engine's
(``tandem.server.engine.kv_handoff``); this package depends on the engine, never the reverse.
"""

"""Prefill/decode disaggregation: KV transfer parameters, leases and transports."""

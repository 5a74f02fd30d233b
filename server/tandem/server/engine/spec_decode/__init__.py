"""Speculative decoding: proposals a request's next tokens may be (``ngram``), the per-request
state that adapts how many to propose (``draft``), and the ``Speculator`` that proposes for the
scheduler and verifies a step's proposals with the engine's own sampler (docs/speculative.md)."""

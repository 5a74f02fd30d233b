"""Speculative decoding: proposals a request's next tokens may be (``ngram``, or a draft model:
``draft_model``, made by ``layer_draft``), the per-request state that adapts how many to propose
(``draft``), the step's cost model that plans them (``cost``), and the ``Speculator`` that
proposes for the scheduler and verifies a step's proposals with the engine's own sampler
(docs/speculative.md)."""

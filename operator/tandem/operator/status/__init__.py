"""Children -> status. Pure: the one place that decides what an InferenceService's status is.

The handlers feed it summaries of what exists (Deployments, Pods, Jobs, the cache claim,
autoscalers) and two facts of their own (the last apply's error, the largest node's GPUs);
it returns a typed :class:`~tandem.operator.spec.status.InferenceServiceStatus`. Whether the
model is ready, whether the service can serve, and which events to post are decided here and
nowhere else, so the handlers never compute readiness a second way.

Status is recomputed whole every time from the children (level-based), never accumulated,
so an operator restart or a missed event cannot leave it stale. Only a condition's
``lastTransitionTime`` is carried over from the previous status, when its value is unchanged.

``children.py`` summarises the children's bodies, ``conditions.py`` decides each condition,
``compute.py`` assembles the whole status, and ``events.py`` says which changes to post.
"""

"""Who sets a pool's replicas: the autoscaler objects, and the operator's own SLO planner.

``spec.<role>.autoscaling.backend`` picks the backend (``docs/autoscaling.md``): ``HPA`` and
``KEDA`` are Kubernetes objects the operator renders (``objects.py``); ``Planner`` is the
operator itself, sizing prefill and decode together for ``spec.slo``.

The planner is pure in the middle and does I/O only at its edge: ``profile.py`` (an engine
replica's measured performance), ``sizing.py`` (load + profile + SLO -> replicas per pool),
``stabilization.py`` (recommendations -> replica changes, without flapping), ``metrics.py``
(the PromQL it reads and the load it makes of the samples), ``planner.py`` (one round, pure)
and ``loop.py`` (one round against Prometheus and the cluster).
"""

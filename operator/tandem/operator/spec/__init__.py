"""The InferenceService spec: the one source of its schema, its defaults and its rules.

Everything else is derived from these models: the CRD's structural schema and CEL rules
(``tandem.operator.crd``), the Helm chart's copy of the CRD, the topology
(``tandem.operator.topology``) that both the operator and ``tandem up`` run. A rule is
written once (:class:`~.rules.Rule`) with its CEL expression for the API server and a Python
predicate for ``load_inference_service``, so a spec that the cluster rejects is rejected
locally with the same message.

Field names are camelCase in YAML (``maxModelLen``) and snake_case in Python
(``max_model_len``); ``spec.engine``'s names are exactly ``EngineConfig``'s fields, so each
maps onto the engine flag of the same name (``--max-model-len``). One module per part of the
object: ``model.py`` (``spec.model``), ``engine.py`` (``spec.engine``), ``roles.py``
(``spec.prefill``/``spec.decode``), ``autoscaling.py`` (their ``autoscaling`` and
``spec.slo``), ``proxy.py`` (``spec.proxy``), ``status.py`` (``status``) and
``inference_service.py`` (the whole object and its loader).
"""

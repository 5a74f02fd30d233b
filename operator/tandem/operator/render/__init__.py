"""Topology -> Kubernetes manifests. Pure: the same spec always renders the same objects.

Every object carries the ``app.kubernetes.io/*`` and ``tandem.dev/*`` labels and, when the
InferenceService has a uid, a controller owner reference to it, so deleting the
InferenceService lets the garbage collector remove everything rendered here. Fields that
another controller owns are left out on purpose: an autoscaled role's Deployment has no
``replicas`` (its HPA, ScaledObject or the planner writes it), so server-side apply never
fights it.

One module per kind of object: ``meta.py`` (every child's name, labels and owner),
``pods.py`` (what every pod shares: resources, security contexts, scrape annotations, the
``podTemplate`` merge), ``security.py`` (the internal credential and the engines'
NetworkPolicy), ``model.py`` (the model cache and its download Job), ``engines.py`` (the
engine pools), ``proxy.py`` (the proxy and its endpoint), and ``manifests.py``
(:func:`~.manifests.render`: all of them, in apply order). ``options.py`` holds the
operator-wide settings.
"""

"""How the gateway talks to workers: one :class:`~gateway.backends.base.Backend` per kind,
chosen by the scheme of the worker URL (:mod:`gateway.backends.registry`)."""

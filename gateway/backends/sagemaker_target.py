"""SageMaker targets written as worker URLs (pure parsing, no AWS SDK import).

A target is one endpoint plus, optionally, a production variant or an inference component::

    sagemaker://ENDPOINT?variant=V&region=us-east-1&body=openai
    sagemaker://ENDPOINT?component=IC&model=llama-3-8b&session=auto

Query parameters (all optional):

``variant``         production variant (``TargetVariant``); without it SageMaker picks by weight
``component``       inference component (``InferenceComponentName``); not with ``variant``
``region``          AWS region (default: the SDK's own resolution, e.g. ``AWS_DEFAULT_REGION``)
``endpoint_url``    another endpoint for both the runtime and the control plane (tests, VPC)
``body``            ``openai`` (messages / prompt as sent, the default) or ``tgi``
                    (``{"inputs", "parameters"}``; the reply is mapped back to the OpenAI shape)
``model``           model name(s) the gateway advertises for it, comma-separated
                    (default: the component name, else the endpoint name)
``prefix_aware``    ``anchor`` (default): send the prefix anchor as ``PrefixAwareId``; ``off``
``session``         ``off`` (default) or ``auto``: stateful sessions for hot prefixes
``session_after``   requests of one prefix before it opens a session (default 2)
``probe``           ``describe`` (default): health from ``DescribeEndpoint``; ``none``: assume up
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, quote, urlencode, urlsplit

SCHEME = "sagemaker"
BODY_SHAPES = ("openai", "tgi")
_KNOWN = frozenset({
    "variant", "component", "region", "endpoint_url", "body", "model", "prefix_aware",
    "session", "session_after", "probe",
})


@dataclass(frozen=True, slots=True)
class SageMakerTarget:
    endpoint: str
    variant: str = ""
    component: str = ""
    region: str = ""
    endpoint_url: str = ""
    body: str = "openai"
    models: tuple[str, ...] = ()
    prefix_aware: bool = True
    sessions: bool = False
    session_after: int = 2
    probe: bool = True

    @property
    def id(self) -> str:
        """Stable, readable worker id: ``sm:[region/]endpoint[/variant | /ic/component]``."""
        out = "sm:" + (f"{self.region}/" if self.region else "") + self.endpoint
        if self.variant:
            out += f"/{self.variant}"
        elif self.component:
            out += f"/ic/{self.component}"
        return out

    def advertised_models(self) -> frozenset[str]:
        return frozenset(self.models or (self.component or self.endpoint,))

    def url(self) -> str:
        """The canonical ``sagemaker://`` URL of this target (round-trips through parse)."""
        query: dict[str, str] = {}
        for name, value in (("variant", self.variant), ("component", self.component),
                            ("region", self.region), ("endpoint_url", self.endpoint_url)):
            if value:
                query[name] = value
        if self.body != "openai":
            query["body"] = self.body
        if self.models:
            query["model"] = ",".join(self.models)
        if not self.prefix_aware:
            query["prefix_aware"] = "off"
        if self.sessions:
            query["session"] = "auto"
            query["session_after"] = str(self.session_after)
        if not self.probe:
            query["probe"] = "none"
        tail = f"?{urlencode(query, safe=':/,')}" if query else ""
        return f"{SCHEME}://{quote(self.endpoint, safe='')}{tail}"


def _one(query: dict[str, list[str]], name: str, default: str = "") -> str:
    values = query.get(name)
    return values[-1].strip() if values else default


def parse_target(url: str) -> SageMakerTarget:
    """Parse a ``sagemaker://`` worker URL; raise :class:`ValueError` naming what is wrong."""
    parts = urlsplit(url)
    if parts.scheme != SCHEME or not parts.netloc:
        raise ValueError(
            f"a SageMaker target looks like sagemaker://ENDPOINT?variant=V, got {url!r}"
        )
    query = parse_qs(parts.query, keep_blank_values=True)
    unknown = set(query) - _KNOWN
    if unknown:
        raise ValueError(f"unknown parameter(s) {', '.join(sorted(unknown))} in {url!r}; "
                         f"known: {', '.join(sorted(_KNOWN))}")
    variant, component = _one(query, "variant"), _one(query, "component")
    if variant and component:
        raise ValueError(f"give variant or component, not both: {url!r}")
    body = _one(query, "body", "openai")
    if body not in BODY_SHAPES:
        raise ValueError(f"body must be one of {', '.join(BODY_SHAPES)}, got {body!r}")
    flags = {
        "prefix_aware": (_one(query, "prefix_aware", "anchor"), ("anchor", "off")),
        "session": (_one(query, "session", "off"), ("auto", "off")),
        "probe": (_one(query, "probe", "describe"), ("describe", "none")),
    }
    for name, (value, allowed) in flags.items():
        if value not in allowed:
            raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
    try:
        session_after = int(_one(query, "session_after", "2"))
    except ValueError as exc:
        raise ValueError(f"session_after must be an integer: {url!r}") from exc
    if session_after < 1:
        raise ValueError("session_after must be >= 1")
    endpoint_url = _one(query, "endpoint_url")
    if endpoint_url and urlsplit(endpoint_url).scheme not in ("http", "https"):
        raise ValueError(f"endpoint_url must be an http(s) URL, got {endpoint_url!r}")
    models = tuple(m.strip() for m in _one(query, "model").split(",") if m.strip())
    return SageMakerTarget(
        endpoint=parts.netloc,
        variant=variant,
        component=component,
        region=_one(query, "region"),
        endpoint_url=endpoint_url,
        body=body,
        models=models,
        prefix_aware=flags["prefix_aware"][0] == "anchor",
        sessions=flags["session"][0] == "auto",
        session_after=session_after,
        probe=flags["probe"][0] == "describe",
    )

"""The LMI container image of a SageMaker deploy: looked up by the sagemaker SDK, else a fallback.

The LMI (DJL Serving) container with vLLM is published per region, from accounts and with tags
that vary by region and release. With the ``sagemaker`` extra installed (the SageMaker Python
SDK's core package), ``image_uris.retrieve("djl-lmi", region, version=...)`` finds the URI in the
tables the SDK ships: no network call, the right account for every region it knows. Without the
SDK, or for a region or version it does not know, the URI falls back to a hard-coded template
that is right for the default version in the regions served from account 763104351884; another
version then needs ``--image``. An image given with ``--image`` is used as given (``{region}``
filled in).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

LMI_FRAMEWORK = "djl-lmi"
DEFAULT_LMI_VERSION = "0.33.0"
FALLBACK_IMAGE = "763104351884.dkr.ecr.{region}.amazonaws.com/djl-inference:0.33.0-lmi15.0.0-cu128"
# Where the SDK keeps it: sagemaker-core (SDK v3), then the v2 package layout.
_SDK_MODULES = ("sagemaker.core.image_uris", "sagemaker.image_uris")

Retrieve = Callable[..., str]
Source = Literal["given", "sdk", "fallback"]


@dataclass(frozen=True, slots=True)
class LmiImage:
    uri: str
    source: Source
    note: str = ""  # why the SDK did not give it, when it did not


def sdk_retrieve() -> Retrieve | None:
    """The SDK's ``image_uris.retrieve``, or ``None`` when the SDK is not installed."""
    for name in _SDK_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        retrieve = getattr(module, "retrieve", None)
        if callable(retrieve):
            found: Retrieve = retrieve
            return found
    return None


def resolve_lmi_image(region: str, version: str = DEFAULT_LMI_VERSION, *,
                      image: str | None = None,
                      retrieve: Retrieve | Literal["sdk"] | None = "sdk") -> LmiImage:
    """The image URI for ``region``; ``retrieve`` is the SDK's lookup (``"sdk"``: import it)."""
    if image:
        return LmiImage(image.format(region=region), "given")
    lookup = sdk_retrieve() if retrieve == "sdk" else retrieve
    if lookup is None:
        note = "the sagemaker SDK is not installed (pip install 'affinity-gateway[sagemaker]')"
    else:
        try:
            return LmiImage(lookup(LMI_FRAMEWORK, region, version=version), "sdk")
        except ValueError as exc:  # a region or version missing from the SDK's tables
            first = str(exc).split(". ")[0]
            note = f"the sagemaker SDK has no LMI {version} image for region {region!r} ({first})"
    if version != DEFAULT_LMI_VERSION:
        raise ValueError(f"{note}; pass --image for LMI {version}")
    return LmiImage(FALLBACK_IMAGE.format(region=region), "fallback", note)

"""The LMI image of ``infra sagemaker deploy``: the sagemaker SDK's lookup, else the fallback.

Offline: the SDK's lookup reads the tables it ships; no test here reaches a network."""

from __future__ import annotations

from typing import Any

import pytest

from infra.sagemaker_image import (
    DEFAULT_LMI_VERSION,
    FALLBACK_IMAGE,
    resolve_lmi_image,
    sdk_retrieve,
)


def test_an_image_given_is_used_with_its_region_filled_in() -> None:
    def never(*_: Any, **__: Any) -> str:
        raise AssertionError("no lookup when an image is given")

    got = resolve_lmi_image("eu-west-1", image="reg.example/{region}/lmi:7", retrieve=never)
    assert (got.uri, got.source) == ("reg.example/eu-west-1/lmi:7", "given")


def test_the_sdk_lookup_gets_framework_region_and_version() -> None:
    calls: list[tuple[Any, ...]] = []

    def retrieve(framework: str, region: str, *, version: str) -> str:
        calls.append((framework, region, version))
        return f"acct.dkr.ecr.{region}.amazonaws.com/djl-inference:{version}-x"

    got = resolve_lmi_image("ap-east-1", "0.38.0", retrieve=retrieve)
    assert calls == [("djl-lmi", "ap-east-1", "0.38.0")]
    assert got.source == "sdk"
    assert got.uri == "acct.dkr.ecr.ap-east-1.amazonaws.com/djl-inference:0.38.0-x"
    assert got.note == ""


def test_a_region_the_sdk_does_not_know_falls_back_with_a_note() -> None:
    def retrieve(framework: str, region: str, *, version: str) -> str:
        raise ValueError(f"Unsupported region: {region}. You may need to upgrade. Supported: ...")

    got = resolve_lmi_image("xx-new-1", retrieve=retrieve)
    assert got.source == "fallback"
    assert got.uri == FALLBACK_IMAGE.format(region="xx-new-1")
    assert "xx-new-1" in got.note
    assert "Unsupported region" in got.note
    assert "Supported:" not in got.note  # one line, not the SDK's list of regions


def test_without_the_sdk_only_the_default_version_has_a_fallback() -> None:
    got = resolve_lmi_image("us-west-2", retrieve=None)
    assert got.source == "fallback"
    assert got.uri == FALLBACK_IMAGE.format(region="us-west-2")
    assert "not installed" in got.note
    with pytest.raises(ValueError, match="--image"):
        resolve_lmi_image("us-west-2", "0.38.0", retrieve=None)


def test_the_installed_sdk_resolves_per_region(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the ``sagemaker`` extra: the SDK's tables, read offline (any AWS or HTTP call would
    go to a closed port)."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    if sdk_retrieve() is None:
        pytest.skip("the sagemaker extra is not installed")
    us = resolve_lmi_image("us-east-1", DEFAULT_LMI_VERSION)
    assert (us.source, us.uri) == ("sdk", FALLBACK_IMAGE.format(region="us-east-1"))
    # A region served from another account: where the hard-coded URI would be wrong.
    cape = resolve_lmi_image("af-south-1", DEFAULT_LMI_VERSION)
    assert cape.source == "sdk"
    assert cape.uri.startswith("626614931356.dkr.ecr.af-south-1.amazonaws.com/djl-inference:")
    assert cape.uri != FALLBACK_IMAGE.format(region="af-south-1")
    newer = resolve_lmi_image("us-east-1", "0.38.0")
    assert newer.source == "sdk"
    assert ":0.38.0-" in newer.uri

"""Origins as --cors-origin takes them, and which requests a Cors allows."""

from __future__ import annotations

import pytest

from gateway.cors import ANY, Cors, normal_origin
from gateway.settings import GatewaySettings


@pytest.mark.parametrize(("given", "normal"), [
    ("http://localhost:3000", "http://localhost:3000"),
    ("HTTPS://App.Example.COM", "https://app.example.com"),
    ("http://[::1]:8080", "http://[::1]:8080"),
    (" * ", ANY),
])
def test_origins_are_taken_as_browsers_send_them(given: str, normal: str) -> None:
    assert normal_origin(given) == normal


@pytest.mark.parametrize("bad", [
    "localhost:3000", "http://app.example/", "http://app.example/path", "ftp://app.example",
    "http://", "http://a b", "http://app.example:3000?x=1", "",
])
def test_what_is_not_an_origin_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="not an origin"):
        normal_origin(bad)
    with pytest.raises(ValueError, match="not an origin"):
        GatewaySettings(cors_origin=(bad,))


def test_allowed_origins() -> None:
    assert not Cors(()).enabled
    some = Cors(("https://App.example",))
    assert some.enabled
    assert some.allowed("https://app.example")
    assert not some.allowed("https://other.example")
    assert not some.allowed(None)
    assert not some.allowed("null")  # a file:// page
    assert Cors(("*",)).allowed("null")

"""The fuzz harness spreads its cases over the operations that take a body."""

from __future__ import annotations

from gateway.openapi import openapi_document
from loadtest.fuzz import body_operations


def test_only_operations_with_a_body_are_counted() -> None:
    document = {"paths": {
        "/a": {"get": {"responses": {}}, "post": {"requestBody": {}, "responses": {}}},
        "/b": {"parameters": [], "post": {"requestBody": {}, "responses": {}},
               "delete": {"responses": {}}},
    }}
    assert body_operations(document) == 2
    assert body_operations({}) == 0


def test_the_gateways_document_has_its_completions_and_chat_among_them() -> None:
    document = openapi_document(["m"])
    posts = sum(1 for item in document["paths"].values() for method in item if method == "post")
    assert 2 <= body_operations(document) <= posts
    assert "requestBody" in document["paths"]["/v1/completions"]["post"]
    assert "requestBody" in document["paths"]["/v1/chat/completions"]["post"]

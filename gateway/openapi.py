"""``GET /openapi.json``: an OpenAPI 3.1 description of the gateway's HTTP API.

The request schemas say what the gateway validates itself (see :mod:`gateway.openai_schema`);
fields it does not interpret are allowed and forwarded. ``model`` lists the models the pool
serves right now (another gets 404), so a schema-driven fuzzer reaches the workers as well as
the gateway's own checks.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gateway.contracts.engine_paths import ENGINE_API_PATHS
from gateway.openai_schema import CHAT_ROLES, MAX_N, MAX_TOKENS_LIMIT

_JSON = "application/json"
_REF_ERROR = {"$ref": "#/components/schemas/Error"}


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": {_JSON: {"schema": _REF_ERROR}}}


_ERRORS = {
    "400": _error("invalid request (OpenAI error shape; ``param`` names the field)"),
    "401": _error("missing or unknown API key (when keys are configured)"),
    "404": _error("unknown model"),
    "413": _error("request body too large"),
    "415": _error("unsupported media type"),
    "429": {
        **_error("over a rate, concurrency or admission limit"),
        "headers": {"Retry-After": {"schema": {"type": "string"},
                                    "description": "seconds to wait"}},
    },
    "502": _error("every worker tried failed before replying"),
    "503": _error("no healthy worker serves the request right now"),
}


def _sampling_fields() -> dict[str, Any]:
    number = {"type": ["number", "null"]}
    return {
        "stream": {"type": ["boolean", "null"]},
        "max_tokens": {"type": ["integer", "null"], "minimum": 1, "maximum": MAX_TOKENS_LIMIT},
        "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1,
                                  "maximum": MAX_TOKENS_LIMIT},
        "n": {"type": ["integer", "null"], "minimum": 1, "maximum": MAX_N},
        "temperature": number,
        "top_p": number,
        "presence_penalty": number,
        "frequency_penalty": number,
        "cache_salt": {"type": ["string", "null"],
                       "description": "narrows the caller's cache namespace; never selects "
                                      "another tenant's"},
        "stream_options": {"type": ["object", "null"]},
    }


def _model(models: Iterable[str]) -> dict[str, Any]:
    """One of the models served now (any other gets 404 ``model_not_found``)."""
    served = sorted(models)
    if served:
        return {"type": "string", "enum": served}
    return {"type": "string", "minLength": 1}


def _completion_request(models: Iterable[str]) -> dict[str, Any]:
    token_ids = _token_ids()
    return {
        "type": "object",
        "required": ["model", "prompt"],
        "properties": {
            "model": _model(models),
            "prompt": {"oneOf": [
                {"type": "string"},
                {"type": "array", "minItems": 1, "items": {"type": "string"}},
                token_ids,
                {"type": "array", "minItems": 1, "items": token_ids},
            ]},
            **_sampling_fields(),
        },
        "additionalProperties": True,
    }


def _chat_request(models: Iterable[str]) -> dict[str, Any]:
    part = {"type": "object", "required": ["type"],
            "properties": {"type": {"type": "string"}, "text": {"type": "string"}}}
    message = {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"type": "string", "enum": sorted(CHAT_ROLES)},
            "content": {"oneOf": [{"type": "string"},
                                  {"type": "array", "items": part}]},
            "name": {"type": "string"},
        },
    }
    return {
        "type": "object",
        "required": ["model", "messages"],
        "properties": {
            "model": _model(models),
            "messages": {"type": "array", "minItems": 1, "items": message},
            "tools": {"type": ["array", "null"], "items": {"type": "object"}},
            **_sampling_fields(),
        },
        "additionalProperties": True,
    }


def _responses_request(models: Iterable[str]) -> dict[str, Any]:
    part = {"type": "object", "required": ["type"],
            "properties": {"type": {"type": "string"}, "text": {"type": "string"}}}
    item = {
        "type": "object",
        "properties": {
            "type": {"type": "string"},
            "role": {"type": "string", "enum": ["user", "assistant", "system", "developer"]},
            "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": part}]},
        },
    }
    return {
        "type": "object",
        "required": ["model", "input"],
        "properties": {
            "model": _model(models),
            "input": {"oneOf": [{"type": "string"},
                                {"type": "array", "minItems": 1, "items": item}]},
            "instructions": {"type": ["string", "null"]},
            "max_output_tokens": {"type": ["integer", "null"], "minimum": 1,
                                  "maximum": MAX_TOKENS_LIMIT},
            "stream": {"type": ["boolean", "null"]},
            "cache_salt": {"type": ["string", "null"]},
            "previous_response_id": {
                "type": ["string", "null"], "minLength": 1, "maxLength": 256,
                "description": "a stored response of the caller's (400 "
                               "previous_response_not_found otherwise); the request goes to "
                               "the worker that stored it"},
            "store": {"type": ["boolean", "null"],
                      "description": "false: the answer is not kept (nor pinned)"},
        },
        "additionalProperties": True,
    }


def _stored_response_paths() -> dict[str, Any]:
    """The paths about one stored response (:mod:`gateway.stored_responses`)."""
    param = [{"name": "response_id", "in": "path", "required": True,
              "schema": {"type": "string"}}]
    statuses = ("401", "404", "502", "503")

    def operation(summary: str) -> dict[str, Any]:
        return {**_get(summary, statuses=statuses), "parameters": param,
                "security": [{"apiKey": []}, {}]}

    return {
        "/v1/responses/{response_id}": {
            "get": operation("A stored response, from the worker that made it"),
            "delete": operation("Delete a stored response on the worker that made it"),
        },
        "/v1/responses/{response_id}/input_items": {
            "get": operation("A stored response's input items")},
        "/v1/responses/{response_id}/cancel": {
            "post": operation("Cancel a response run in the background")},
    }


def _token_ids() -> dict[str, Any]:
    return {"type": "array", "minItems": 1,
            "items": {"type": "integer", "minimum": 0, "maximum": 2**32 - 1}}


def _engine_request(models: Iterable[str], required: Iterable[str] = (),
                    **fields: Any) -> dict[str, Any]:
    """A request relayed to the engine as it is (:mod:`gateway.engine_api`): ``model`` may be
    left out when the pool serves one; the engine validates the rest."""
    return {
        "type": "object",
        "required": list(required),
        "properties": {"model": _model(models), "cache_salt": {"type": ["string", "null"]},
                       **fields},
        "additionalProperties": True,
    }


def _engine_requests(models: Iterable[str]) -> dict[str, dict[str, Any]]:
    served = list(models)
    ids = _token_ids()
    return {
        "EmbeddingRequest": _engine_request(served, ["input"], input={"oneOf": [
            {"type": "string"}, {"type": "array", "minItems": 1, "items": {"type": "string"}},
            ids, {"type": "array", "minItems": 1, "items": ids}]},
            encoding_format={"type": "string", "enum": ["float", "base64"]},
            dimensions={"type": "integer", "minimum": 1}),
        "TokenizeRequest": _engine_request(served, prompt={"type": "string"},
                                           messages={"type": "array", "items": {
                                               "type": "object"}}),
        "DetokenizeRequest": _engine_request(served, ["tokens"], tokens=ids),
        "EngineRequest": _engine_request(served),
    }


def _engine_paths() -> dict[str, Any]:
    schema = {"/v1/embeddings": "EmbeddingRequest", "/tokenize": "TokenizeRequest",
              "/detokenize": "DetokenizeRequest"}
    return {path: {"post": _post("Relayed to the least loaded worker that serves the model "
                                 "(the engine's own API)", schema.get(path, "EngineRequest"))}
            for path in sorted(ENGINE_API_PATHS)}


def _post(summary: str, schema_name: str) -> dict[str, Any]:
    return {
        "summary": summary,
        "security": [{"apiKey": []}, {}],
        "requestBody": {"required": True, "content": {
            _JSON: {"schema": {"$ref": f"#/components/schemas/{schema_name}"}}}},
        "responses": {
            "200": {"description": "the worker's answer, as JSON or as server-sent events",
                    "content": {_JSON: {"schema": {"type": "object"}},
                                "text/event-stream": {"schema": {"type": "string"}}}},
            **_ERRORS,
        },
    }


def _get(summary: str, content_type: str = _JSON, *, admin: bool = False,
         statuses: Iterable[str] = ()) -> dict[str, Any]:
    operation: dict[str, Any] = {
        "summary": summary,
        "responses": {
            "200": {"description": "OK", "content": {content_type: {"schema": (
                {"type": "object"} if content_type == _JSON else {"type": "string"})}}},
            **{s: _error("see the error message") for s in statuses},
        },
    }
    if admin:
        operation["security"] = [{"adminToken": []}, {}]
        operation["responses"].update({"401": _ERRORS["401"],
                                       "403": _error("admin endpoints are closed here")})
    return operation


def openapi_document(models: Iterable[str]) -> dict[str, Any]:
    served = list(models)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "affinity-gateway",
            "version": "0.1.0",
            "description": "Cache-affinity routing gateway with an OpenAI-compatible API.",
        },
        "paths": {
            "/v1/completions": {"post": _post("Text completion, routed by prompt prefix",
                                              "CompletionRequest")},
            "/v1/chat/completions": {"post": _post("Chat completion, routed by prompt prefix",
                                                   "ChatCompletionRequest")},
            "/v1/responses": {"post": _post("Responses API, routed by the prefix of the chat "
                                            "it amounts to", "ResponsesRequest")},
            "/v1/models": {"get": {**_get("Models the healthy workers serve",
                                          statuses=("401",)),
                                   "security": [{"apiKey": []}, {}]}},
            "/health": {"get": _get("Liveness")},
            "/ready": {"get": _get("Readiness: at least one healthy worker",
                                   statuses=("503",))},
            "/metrics": {"get": _get("Prometheus metrics", "text/plain", admin=True)},
            "/admin/workers": {"get": _get("Workers, their health, load and cache", admin=True)},
            "/admin/rebalance": {"get": _get("Store, rebalancer state and ring weights",
                                             admin=True)},
            "/openapi.json": {"get": _get("This document")},
            **_stored_response_paths(),
            **_engine_paths(),
        },
        "components": {
            "schemas": {
                "CompletionRequest": _completion_request(served),
                "ChatCompletionRequest": _chat_request(served),
                "ResponsesRequest": _responses_request(served),
                **_engine_requests(served),
                "Error": {
                    "type": "object",
                    "required": ["error"],
                    "properties": {"error": {
                        "type": "object",
                        "required": ["message", "type"],
                        "properties": {
                            "message": {"type": "string"},
                            "type": {"type": "string"},
                            "param": {"type": ["string", "null"]},
                            "code": {"type": ["string", "null"]},
                        },
                    }},
                },
            },
            "securitySchemes": {
                "apiKey": {"type": "http", "scheme": "bearer",
                           "description": "a tenant's API key (--api-key, --api-keys-file)"},
                "adminToken": {"type": "http", "scheme": "bearer",
                               "description": "the admin token (--admin-token)"},
            },
        },
    }

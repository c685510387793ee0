"""OpenAI's response_format (and forced tool calls) as JSON schemas for constrained decoding.

Schemas are checked here, in the API process, so a bad one is a 400 naming the problem; the
worker compiles each distinct schema once.
"""

from __future__ import annotations

import json
from typing import Any

from api_server.protocol import RequestError
from pipelines.grammar import grammar_for_json_schema

ANY_JSON_OBJECT = {"type": "object"}


def validate_schema(schema: Any, param: str) -> str:
    """The schema as the string the worker compiles; RequestError if llguidance rejects it."""
    if not isinstance(schema, dict):
        raise RequestError("the JSON schema must be an object", param=param)
    # Property order is generation order: keep the user's.
    return validate_grammar(json.dumps(schema), param)


def validate_grammar(text: str, param: str) -> str:
    """A JSON schema's text, or a Lark grammar built here (its %json rules hold request
    schemas): RequestError naming `param` if llguidance rejects it."""
    import llguidance

    try:
        grammar = grammar_for_json_schema(text)
    except ValueError as exc:
        raise RequestError(f"invalid JSON schema: {exc}", param=param) from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise RequestError(f"unsupported or invalid JSON schema: {messages[0]}", param=param)
    return text


def schema_for_response_format(response_format) -> str | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return validate_schema(ANY_JSON_OBJECT, "response_format")
    spec = response_format.json_schema
    if spec is None or spec.schema_ is None:
        raise RequestError("response_format of type json_schema needs json_schema.schema",
                           param="response_format.json_schema")
    return validate_schema(spec.schema_, "response_format.json_schema.schema")

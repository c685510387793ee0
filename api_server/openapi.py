"""/openapi.json: generated from the same msgspec structs that validate the requests, so
the document and the server cannot drift apart."""

from __future__ import annotations

import msgspec

from api_server.anthropic_protocol import CountTokensRequest, MessagesRequest
from api_server.embeddings_route import EmbeddingRequest
from api_server.extra_routes import DetokenizeRequest, TokenizeRequest
from api_server.images_route import FORMATS, ImagesRequest
from api_server.protocol import ChatCompletionRequest, CompletionRequest
from api_server.responses_protocol import ResponsesRequest
from api_server.speech_route import SpeechRequest

_REF = "#/components/schemas/{name}"

ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {
            "message": {"type": "string"},
            "type": {"type": "string"},
            "param": {"type": ["string", "null"]},
            "code": {"type": ["string", "null"]},
        },
    }},
}


# Anthropic's routes answer errors in Anthropic's shape.
ANTHROPIC_ERROR_SCHEMA = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {"type": {"const": "error"}, "error": {
        "type": "object",
        "required": ["type", "message"],
        "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
    }},
}


def _responses(*errors: int, content_type: str = "application/json",
               error: str = "Error") -> dict:
    out = {"200": {"description": "OK", "content": {content_type: {"schema": {}}}}}
    for status in errors:
        out[str(status)] = {"description": "error", "content": {
            "application/json": {"schema": {"$ref": _REF.format(name=error)}}}}
    return out


def _post(schema: str, summary: str, stream: bool = False, error: str = "Error") -> dict:
    # 403: a refused Host or Origin; 415: a body not sent as application/json.
    responses = _responses(400, 401, 403, 404, 408, 413, 415, 429, 503, error=error)
    if stream:
        # Events are JSON chunks, then the literal [DONE].
        responses["200"]["content"]["text/event-stream"] = {"schema": {}}
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {
            "application/json": {"schema": {"$ref": _REF.format(name=schema)}}}},
        "responses": responses,
    }}


def _speech_post() -> dict:
    op = _post("SpeechRequest", "Text to speech: the body is the audio", stream=True)
    content = op["post"]["responses"]["200"]["content"]
    for media in ("audio/wav", "audio/pcm"):
        content[media] = {"schema": {"type": "string", "format": "binary"}}
    return op


def _image_content_get() -> dict:
    op = _get("An image generated with response_format url (kept for a limited time and "
              "number)", errors=(401, 404))
    op["get"]["responses"]["200"]["content"] = {
        f"image/{fmt}": {"schema": {"type": "string", "format": "binary"}} for fmt in FORMATS}
    op["get"]["parameters"] = [{"name": "image_id", "in": "path", "required": True,
                                "schema": {"type": "string"}}]
    return op


def _get(summary: str, content_type: str = "application/json", errors=(401,)) -> dict:
    return {"get": {"summary": summary, "responses": _responses(*errors,
                                                                content_type=content_type)}}


def build_openapi(version: str) -> dict:
    _, components = msgspec.json.schema_components(
        [CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest,
         EmbeddingRequest, SpeechRequest, ResponsesRequest, MessagesRequest,
         CountTokensRequest, ImagesRequest],
        ref_template=_REF,
    )
    components["Error"] = ERROR_SCHEMA
    components["AnthropicError"] = ANTHROPIC_ERROR_SCHEMA
    model_get = _get("One model", errors=(401, 404))
    model_get["get"]["parameters"] = [{"name": "model", "in": "path", "required": True,
                                       "schema": {"type": "string"}}]
    return {
        "openapi": "3.1.0",
        "info": {"title": "Loom", "version": version,
                 "description": "OpenAI-compatible LLM serving"},
        "paths": {
            "/v1/completions": _post("CompletionRequest", "Text completion", stream=True),
            "/v1/chat/completions": _post("ChatCompletionRequest", "Chat completion",
                                          stream=True),
            "/v1/responses": _post("ResponsesRequest", "A response (OpenAI's Responses API)",
                                   stream=True),
            "/v1/messages": _post("MessagesRequest", "A message (Anthropic's Messages API)",
                                  stream=True, error="AnthropicError"),
            "/v1/messages/count_tokens": _post("CountTokensRequest",
                                               "The prompt tokens of a message request",
                                               error="AnthropicError"),
            "/v1/embeddings": _post("EmbeddingRequest", "Embeddings (on an embeddings server)"),
            "/v1/audio/speech": _speech_post(),
            "/v1/images/generations": _post(
                "ImagesRequest", "Images from a prompt (OpenAI's Images API; on a server with "
                "an image model): JSON, or image_generation.* events with stream", stream=True),
            "/v1/images/{image_id}/content": _image_content_get(),
            "/tokenize": _post("TokenizeRequest", "Tokenize a prompt or chat messages"),
            "/detokenize": _post("DetokenizeRequest", "Token ids back to text"),
            "/v1/models": _get("Served models"),
            "/v1/models/{model}": model_get,
            "/health": _get("200 when ready to serve, 503 otherwise", errors=(503,)),
            "/live": _get("200 while the API process's event loop runs (liveness)", errors=()),
            "/version": _get("Server version"),
            "/metrics": _get("Prometheus metrics", content_type="text/plain", errors=()),
        },
        "components": {"schemas": components},
    }

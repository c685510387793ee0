"""One definition of how a request's grammar becomes an llguidance grammar, shared by the API
process (which validates it) and the worker (which compiles it).

The grammar travels as text: a JSON schema (a JSON object, the usual case), or a Lark
grammar whose `%json` rules hold schemas (tools beside a response format: either an answer in
the format or tool calls)."""

from __future__ import annotations

# Compact JSON with the usual separators and no free-form whitespace: a small model given
# whitespace freedom tends to emit newlines forever instead of closing the object.
JSON_GRAMMAR_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ",
                        "key_separator": ": "}


def grammar_for_json_schema(spec: str) -> str:
    import llguidance

    if not spec.lstrip().startswith("{"):  # JSON schemas are objects; Lark never starts so
        return llguidance.LLMatcher.grammar_from_lark(spec)
    return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_GRAMMAR_OPTIONS)

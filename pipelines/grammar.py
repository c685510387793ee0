"""One definition of how a JSON schema becomes an llguidance grammar, shared by the API
process (which validates it) and the worker (which compiles it)."""

from __future__ import annotations

# Compact JSON with the usual separators and no free-form whitespace: a small model given
# whitespace freedom tends to emit newlines forever instead of closing the object.
JSON_GRAMMAR_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ",
                        "key_separator": ": "}


def grammar_for_json_schema(schema_text: str) -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_json_schema(schema_text,
                                                         defaults=JSON_GRAMMAR_OPTIONS)

"""Checks a parsed tool call against the tool's parameter schema.

A call that fails is still returned (the client decides what to do with it); it is counted in
`loom:tool_call_schema_failures_total`, so an operator sees a model that calls tools badly.

The schemas come from the request, so the check must not be a way to stall the event loop:
it runs off the loop (api_server/off_loop.py); `pattern` and `patternProperties` run on the
`regex` module (Python's `re` backtracks without bound) with the GIL released, each search
under a deadline and all searches of a request under one budget (25 items x 20 backtracking
patterns were 25 s of 50 ms searches); formats are not asserted, and a schema that can't be
evaluated (invalid, unresolvable `$ref`, recursion, the budget spent) counts as no verdict
rather than a failure.
"""

from __future__ import annotations

import json
import logging
import threading
import time

import regex

from api_server.tool_calls import ToolCall

logger = logging.getLogger("loom.api")

PATTERN_TIMEOUT_S = 0.05  # one search
PATTERN_BUDGET_S = 0.5  # all the checks of one request, enforced at each search
_VALIDATOR = None
_deadline = threading.local()  # of the check running on this thread


class _OutOfTime(Exception):
    """The request's pattern budget is spent: no verdict."""


def _search(pattern: str, text: str) -> bool:
    left = _deadline.at - time.monotonic()
    if left <= 0:
        raise _OutOfTime
    try:
        return regex.search(pattern, text, timeout=min(PATTERN_TIMEOUT_S, left),
                            concurrent=True) is not None
    except TimeoutError:
        return False
    except regex.error:
        return True  # a pattern Python can't read: no verdict


def _validator_class():
    global _VALIDATOR
    if _VALIDATOR is None:
        import jsonschema
        from jsonschema import ValidationError

        def pattern(validator, patrn, instance, schema):
            if validator.is_type(instance, "string") and not _search(patrn, instance):
                yield ValidationError(f"{instance!r} does not match {patrn!r}")

        def pattern_properties(validator, patterns, instance, schema):
            if not validator.is_type(instance, "object"):
                return
            for patrn, subschema in patterns.items():
                for key, value in instance.items():
                    if _search(patrn, key):
                        yield from validator.descend(value, subschema, path=key,
                                                     schema_path=patrn)

        _VALIDATOR = jsonschema.validators.extend(
            jsonschema.Draft202012Validator,
            {"pattern": pattern, "patternProperties": pattern_properties})
    return _VALIDATOR


class ToolCallChecker:
    """The tools of one request; `check` says whether a call fits them."""

    def __init__(self, tools: list[dict], failures=None,
                 pattern_budget_s: float = PATTERN_BUDGET_S) -> None:
        self.schemas = {t["function"]["name"]: t["function"].get("parameters") or {}
                        for t in tools}
        self.failures = failures  # a prometheus counter, or None
        self._validators: dict[str, object] = {}
        self.pattern_time_left = pattern_budget_s
        self._lock = threading.Lock()  # the calls of n choices may be checked at once

    def check(self, call: ToolCall) -> bool:
        ok = self._fits(call)
        if not ok and self.failures is not None:
            self.failures.inc()
        return ok

    def _fits(self, call: ToolCall) -> bool:
        if call.name not in self.schemas:
            return False
        with self._lock:
            started = time.monotonic()
            _deadline.at = started + self.pattern_time_left
            try:
                return self._valid(call)
            finally:
                self.pattern_time_left -= time.monotonic() - started

    def _valid(self, call: ToolCall) -> bool:
        try:
            validator = self._validator(call.name)
            if validator is None:
                return True
            return validator.is_valid(json.loads(call.arguments))
        except (RecursionError, _OutOfTime):
            return True
        except Exception as exc:  # the schema, not the call: no verdict
            logger.debug("tool schema of %s could not be evaluated: %s", call.name, exc)
            return True

    def _validator(self, name: str):
        if name not in self._validators:
            cls = _validator_class()
            schema = self.schemas[name]
            try:
                cls.check_schema(schema)
                self._validators[name] = cls(schema)
            except Exception:  # an invalid schema: nothing to check against
                self._validators[name] = None
        return self._validators[name]

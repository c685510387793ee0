"""LiteLLM against `loom serve` as an OpenAI-compatible provider (`openai/<model>` with
api_base), as its documentation shows: a forced tool whose parameters nest a model, a
pydantic response_format, and a streamed forced call."""

import json
import os

# LiteLLM fetches its model price list from GitHub as it is imported (and retries for seconds
# where there is no network); its own switch keeps it to the copy it ships.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import litellm  # noqa: E402
import openai  # noqa: E402
import pytest  # noqa: E402

from tests.client_models import MODEL, Address, Person  # noqa: E402

TOOL = openai.pydantic_function_tool(Person, name="save_person")
ASK = [{"role": "user", "content": "Save Ann, who lives in Paris."}]


@pytest.fixture(scope="module")
def call(client_server):
    def call(**kwargs):
        return litellm.completion(model=f"openai/{MODEL}", api_base=client_server.url + "/v1",
                                  api_key="x", messages=ASK, temperature=0, max_tokens=200,
                                  **kwargs)
    return call


def test_forced_nested_tool(call):
    r = call(tools=[TOOL], tool_choice="required")
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls
    assert all(Person.model_validate_json(c.function.arguments) for c in calls)


def test_nested_response_format(call):
    r = call(response_format=Person)
    person = Person.model_validate_json(r.choices[0].message.content)
    assert isinstance(person.home, Address)


def test_streamed_forced_tool(call):
    chunks = list(call(tools=[TOOL], stream=True,
                       tool_choice={"type": "function", "function": {"name": "save_person"}}))
    arguments = "".join(tc.function.arguments or "" for c in chunks
                        for tc in (c.choices[0].delta.tool_calls or []))
    Person.model_validate(json.loads(arguments))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

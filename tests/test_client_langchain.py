"""LangChain's `ChatOpenAI` (langchain-openai) against `loom serve` with a custom base_url:
structured output of a nested model by function calling (a forced call) and by json_schema
(a response format), bound tools forced and streamed as tool-call chunks, on chat and on the
Responses API."""

import pytest
from langchain_openai import ChatOpenAI

from tests.client_models import MODEL, Address, Person, save_person


@pytest.fixture(scope="module")
def url(client_server):
    return client_server.url + "/v1"


def chat(url: str, **kwargs) -> ChatOpenAI:
    return ChatOpenAI(model=MODEL, base_url=url, api_key="x", temperature=0, max_tokens=200,
                      max_retries=0, **kwargs)


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
@pytest.mark.parametrize("responses", [False, True])
def test_structured_output_nested(url, method, responses):
    llm = chat(url, use_responses_api=responses).with_structured_output(Person, method=method)
    person = llm.invoke("Who is Ann?")
    assert isinstance(person, Person) and isinstance(person.home, Address)


def test_forced_tool_streamed(url):
    llm = chat(url).bind_tools([save_person], tool_choice="save_person")
    message = llm.invoke("Save Ann, who lives in Paris.")
    assert message.tool_calls and message.tool_calls[0]["name"] == "save_person"
    Person.model_validate(message.tool_calls[0]["args"]["person"])
    chunks = list(llm.stream("Save Ann, who lives in Paris."))
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole += chunk
    # The same greedy call, streamed (its id is new).
    assert [(c["name"], c["args"]) for c in whole.tool_calls] == \
        [(c["name"], c["args"]) for c in message.tool_calls]
    assert whole.response_metadata.get("finish_reason") == "tool_calls"

"""The OpenAI Agents SDK (`openai-agents`) against `loom serve`, as its documentation sets up
a custom OpenAI-compatible endpoint: a tool whose parameter is a nested pydantic model under
tool_choice required, tools beside an output_type, a nested output_type alone, and a run
chained by previous_response_id with the SDK's default settings (store left out)."""

import asyncio

import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

from tests.client_models import MODEL, Address, Person

set_tracing_disabled(True)  # no tracing export: the machine is offline

saved: list[Person] = []


@function_tool
def save_person(person: Person) -> str:
    """Save a person."""
    saved.append(person)
    return f"saved {person.name}"


GREEDY = ModelSettings(temperature=0, max_tokens=200)


@pytest.fixture(scope="module")
def url(client_server):
    return client_server.url + "/v1"


def model(url: str, api: str = "responses"):
    """The SDK's model over a client of its own: an AsyncOpenAI client is bound to the event
    loop it first ran on, and each test runs its own loop."""
    client = AsyncOpenAI(base_url=url, api_key="x", max_retries=0)
    kind = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
    return kind(model=MODEL, openai_client=client)


def run(agent: Agent, prompt: str, **kwargs):
    return asyncio.run(Runner.run(agent, prompt, max_turns=2, **kwargs))


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_required_tool_with_nested_model(url, api):
    saved.clear()
    agent = Agent(name="clerk", instructions="Save the person.", model=model(url, api),
                  tools=[save_person], tool_use_behavior="stop_on_first_tool",
                  model_settings=GREEDY.resolve(ModelSettings(tool_choice="required")))
    result = run(agent, "Save Ann, who lives in Paris.")
    assert saved and isinstance(saved[0].home, Address)
    assert result.final_output == f"saved {saved[0].name}"


def test_tools_beside_output_type(url):
    saved.clear()
    agent = Agent(name="clerk", model=model(url),
                  tools=[save_person], output_type=Address,
                  tool_use_behavior="stop_on_first_tool",
                  model_settings=GREEDY.resolve(ModelSettings(tool_choice="required")))
    result = run(agent, "Save Ann.")
    assert saved and result.final_output == f"saved {saved[0].name}"


def test_nested_output_type_and_chained_run(url):
    agent = Agent(name="clerk", model=model(url), output_type=Person, model_settings=GREEDY)
    first = run(agent, "Who is Ann?")
    assert isinstance(first.final_output, Person)
    agent = agent.clone(model=model(url))
    second = run(agent, "And Bob?", previous_response_id=first.last_response_id)
    assert isinstance(second.final_output, Person)

"""pydantic-ai against `loom serve` through its OpenAI provider, as its documentation points it
at an OpenAI-compatible server: a nested output type as its default tool output (a forced
call), as native structured output (a response format), on chat and on Responses, and a
function tool whose parameter is a nested model."""

import pytest
from pydantic_ai import Agent, NativeOutput
from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
from pydantic_ai.providers.openai import OpenAIProvider

from tests.client_models import MODEL, Address, Person

SETTINGS = {"temperature": 0, "max_tokens": 200}


@pytest.fixture(scope="module")
def provider(client_server):
    return OpenAIProvider(base_url=client_server.url + "/v1", api_key="x")


@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("native", [False, True])
def test_nested_output_type(provider, api, native):
    model = (OpenAIChatModel if api == "chat" else OpenAIResponsesModel)(MODEL,
                                                                         provider=provider)
    agent = Agent(model, output_type=NativeOutput(Person) if native else Person,
                  model_settings=SETTINGS)
    result = agent.run_sync("Who is Ann?")
    assert isinstance(result.output, Person) and isinstance(result.output.home, Address)


def test_nested_model_tool_parameter(provider):
    """Forced to the tool, whose result ends the run (its output is the tool's return)."""
    saved: list[Person] = []

    def save_person(person: Person) -> str:
        """Save a person."""
        saved.append(person)
        return f"saved {person.name}"

    agent = Agent(OpenAIChatModel(MODEL, provider=provider), output_type=[save_person],
                  model_settings=SETTINGS)
    result = agent.run_sync("Save Ann, who lives in Paris.")
    assert saved and result.output == f"saved {saved[0].name}"

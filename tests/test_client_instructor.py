"""instructor against `loom serve` through the openai client it patches, as its documentation
shows: a nested response_model by forced tool call (TOOLS, and RESPONSES_TOOLS, which sends a
forced tool and a text format together) and a list of models.

(Not JSON_SCHEMA mode here: it sends pydantic's schema unclosed, so the grammar admits extra
keys, and the tiny random model adds them until max_tokens.)"""

import instructor
import openai
import pytest

from tests.client_models import MODEL, Address, Person


@pytest.fixture(scope="module")
def openai_client(client_server):
    return openai.OpenAI(base_url=client_server.url + "/v1", api_key="x", max_retries=0)


def test_nested_response_model(openai_client):
    client = instructor.from_openai(openai_client, mode=instructor.Mode.TOOLS)
    person = client.chat.completions.create(
        model=MODEL, response_model=Person, max_retries=0, temperature=0, max_tokens=200,
        messages=[{"role": "user", "content": "Who is Ann?"}])
    assert isinstance(person, Person) and isinstance(person.home, Address)


def test_responses_tools_mode(openai_client):
    client = instructor.from_openai(openai_client, mode=instructor.Mode.RESPONSES_TOOLS)
    person = client.responses.create(
        model=MODEL, response_model=Person, max_retries=0, temperature=0,
        max_output_tokens=200, input=[{"role": "user", "content": "Who is Ann?"}])
    assert isinstance(person, Person)


def test_list_of_models(openai_client):
    client = instructor.from_openai(openai_client, mode=instructor.Mode.TOOLS)
    people = client.chat.completions.create(
        model=MODEL, response_model=list[Person], max_retries=0, temperature=0,
        max_tokens=300, messages=[{"role": "user", "content": "Who are Ann and Bob?"}])
    # (The schema lets the list be empty; the random model may choose that: the point is a
    # forced call whose list items are nested models, which used to be a 400.)
    assert isinstance(people, list) and all(isinstance(p, Person) for p in people)

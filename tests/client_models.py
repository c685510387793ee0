"""Pydantic models the client-library tests send as tool parameters and output types: nested
(their JSON schemas hold `$defs` and `$ref`), with every field bounded so that even the tiny
random model's grammar-constrained output ends well within a small max_tokens."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

MODEL = "tiny"


class Address(BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]
    floor: int = Field(ge=0, le=9)


class Person(BaseModel):
    """A person and where they live."""

    name: str = Field(max_length=6)
    home: Address


class Node(BaseModel):
    """A tree: the schema refers to itself."""

    label: Literal["a", "b"]
    children: list[Node] = Field(max_length=2)


def save_person(person: Person) -> str:
    """Save a person."""
    return f"saved {person.name}"

"""Structured outputs through the official `openai` client and langchain-openai.

Usage: python structured_outputs.py BASE_URL MODEL
The model has random weights: only the server's grammar mask makes its
output parse. Every answer is validated with `jsonschema` against the schema
that was sent. Exits non-zero (with a message) on the first failure.
"""
import json
import sys
from typing import Literal

import jsonschema
import openai
from langchain_openai import ChatOpenAI
from openai import OpenAI
from pydantic import BaseModel, Field

base_url, model = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=base_url, api_key="test-key")
messages = [{"role": "user", "content": "Describe a person."}]


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=150)
    mood: Literal["happy", "sad"]


class Address(BaseModel):
    city: str = Field(max_length=6)
    zip: int = Field(ge=10000, le=99999)


class Contact(BaseModel):
    """Nested models: pydantic's schema uses $defs and $ref."""
    person: Person
    address: Address
    tags: list[Literal["work", "home"]] = Field(max_length=2)


# chat.completions.parse with pydantic models, greedy and sampled.
for cls in (Person, Contact):
    for temperature, seed in [(0, 0), (0.8, 1), (1.5, 2)]:
        r = client.chat.completions.parse(model=model, messages=messages, response_format=cls,
                                          temperature=temperature, seed=seed, max_tokens=300)
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (cls.__name__, temperature, choice)
        assert isinstance(choice.message.parsed, cls), choice.message
        jsonschema.validate(json.loads(choice.message.content), cls.model_json_schema())

# The same, streamed.
with client.chat.completions.stream(model=model, messages=messages, response_format=Contact,
                                    temperature=1.0, seed=11, max_tokens=300) as stream:
    final = stream.get_final_completion()
assert isinstance(final.choices[0].message.parsed, Contact), final

# A hand-written schema through response_format, many seeds, with a stop string.
schema = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": -5, "maximum": 5},
        "ok": {"type": "boolean"},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "kind": {"enum": ["a", "b", None]},
        "note": {"type": ["string", "null"], "maxLength": 5},
        "list": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                 "minItems": 1, "maxItems": 3},
    },
    "required": ["id", "ok", "score", "kind", "list"],
    "additionalProperties": False,
}
fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}
finished = 0
for seed in range(12):
    temperature = [0.0, 0.5, 1.0, 2.0][seed % 4]
    r = client.chat.completions.create(model=model, messages=messages, response_format=fmt, temperature=temperature,
                                       seed=seed, max_tokens=300, stop=["\n"])
    c = r.choices[0]
    if c.finish_reason == "length":  # a number's digits may run long; the text is then a prefix
        continue
    finished += 1
    jsonschema.validate(json.loads(c.message.content), schema)
assert finished >= 8, f"only {finished} of 12 runs ended"

# A schema the compiler rejects: a 400 naming response_format.
try:
    client.chat.completions.create(model=model, messages=messages, max_tokens=4, response_format={
        "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}})
    raise AssertionError("an unsatisfiable schema was accepted")
except openai.BadRequestError as e:
    assert e.body["param"] == "response_format", e.body

# langchain-openai: with_structured_output, pydantic and dict schemas, streaming too.
llm = ChatOpenAI(base_url=base_url, api_key="test-key", model=model, temperature=0, max_tokens=300)
person = llm.with_structured_output(Person).invoke("Describe a person.")
assert isinstance(person, Person), person
contact = llm.with_structured_output(Contact, method="json_schema").invoke("Describe a contact.")
assert isinstance(contact, Contact), contact
as_dict = llm.with_structured_output({"title": "thing", **schema}, method="json_schema").invoke("A thing.")
jsonschema.validate(as_dict, schema)
chunks = list(llm.with_structured_output(Person).stream("Describe a person."))
assert chunks and isinstance(chunks[-1], Person), chunks

print("structured outputs: ok")

"""Tool calling through the official `openai` client and langchain-openai.

Usage: python tool_calls.py BASE_URL MODEL
The model has random weights: every call here is forced (tool_choice
"required" or a named function), so the server's grammar makes it.
Exits non-zero (with a message) on the first mismatch.
"""
import json
import sys
from typing import Literal

import openai
from openai import OpenAI
from pydantic import BaseModel, Field

base_url, model = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=base_url, api_key="test-key")


class GetWeather(BaseModel):
    """The weather in a city."""

    city: Literal["Paris", "Zurich", "Lima"]
    days: int = Field(ge=1, le=7)


weather = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": GetWeather.model_json_schema(),
    },
}
messages = [{"role": "user", "content": "What is the weather in Paris?"}]
common = dict(model=model, max_tokens=100, temperature=0, parallel_tool_calls=False)

# create: a forced call, its arguments valid against the schema.
r = client.chat.completions.create(messages=messages, tools=[weather], tool_choice="required", **common)
choice = r.choices[0]
assert choice.finish_reason == "tool_calls", r
call = choice.message.tool_calls[0]
assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather", call
GetWeather.model_validate_json(call.function.arguments)

# Streamed: the client's accumulation of the deltas gives the same call.
stream = client.chat.completions.create(
    messages=messages, tools=[weather], tool_choice={"type": "function", "function": {"name": "get_weather"}},
    stream=True, **common)
names, arguments, finish = [], "", None
for chunk in stream:
    delta = chunk.choices[0].delta
    assert not delta.content, delta
    for piece in delta.tool_calls or []:
        assert piece.index == 0, piece
        if piece.function.name:
            assert piece.id.startswith("call_") and piece.type == "function", piece
            names.append(piece.function.name)
        arguments += piece.function.arguments or ""
    finish = chunk.choices[0].finish_reason or finish
assert names == ["get_weather"] and finish == "tool_calls", (names, finish)
assert json.loads(arguments) == json.loads(call.function.arguments), (arguments, call)

# The call and its result sent back: the conversation goes on (auto: the model answers in text).
followup = messages + [
    choice.message.model_dump(exclude_none=True),
    {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp": 21})},
]
r2 = client.chat.completions.create(messages=followup, tools=[weather], model=model, max_tokens=8, temperature=0)
assert r2.choices[0].message.content is not None and not r2.choices[0].message.tool_calls, r2

# parse with a pydantic tool (strict): the arguments come back as the model class.
parsed = client.chat.completions.parse(
    messages=messages, tools=[openai.pydantic_function_tool(GetWeather)], tool_choice="required", **common)
arguments = parsed.choices[0].message.tool_calls[0].function.parsed_arguments
assert isinstance(arguments, GetWeather), arguments

# langchain-openai: bind_tools (forced: "any" is "required") and with_structured_output.
from langchain_openai import ChatOpenAI  # noqa: E402

llm = ChatOpenAI(base_url=base_url, api_key="test-key", model=model, temperature=0, max_tokens=100)
bound = llm.bind_tools([GetWeather], tool_choice="any", parallel_tool_calls=False)
message = bound.invoke("What is the weather in Paris?")
assert len(message.tool_calls) == 1 and message.tool_calls[0]["name"] == "GetWeather", message
GetWeather.model_validate(message.tool_calls[0]["args"])
gathered = None
for piece in bound.stream("What is the weather in Paris?"):
    gathered = piece if gathered is None else gathered + piece
assert gathered.tool_calls == message.tool_calls or [c["args"] for c in gathered.tool_calls] == [
    c["args"] for c in message.tool_calls], (gathered.tool_calls, message.tool_calls)
structured = llm.with_structured_output(GetWeather, method="function_calling")
result = structured.invoke("What is the weather in Paris?")
assert isinstance(result, GetWeather), result

print("tool calls: ok")

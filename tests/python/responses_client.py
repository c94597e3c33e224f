"""The official `openai` client's Responses API against a running cluster:
create and stream, forced function calls created and streamed, a call's
output sent back through previous_response_id, retrieve and delete, a JSON
schema through text.format, and errors.

Usage: python responses_client.py BASE_URL MODEL
The model has random weights: every call here is forced, so the server's
grammar makes it. Exits non-zero (with a message) on the first mismatch.
"""
import json
import sys

import openai
from openai import OpenAI

base_url, model = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=base_url, api_key="test-key", max_retries=0)
story = "Tell me a story."

r = client.responses.create(model=model, input=story, max_output_tokens=12, temperature=0)
assert r.id.startswith("resp_") and r.object == "response" and r.status in ("completed", "incomplete"), r
assert r.output_text and r.output[0].type == "message", r
assert r.usage.output_tokens > 0 and r.usage.input_tokens > 0, r.usage

# Streamed: the client's accumulated response equals the whole one.
with client.responses.stream(model=model, input=story, max_output_tokens=12, temperature=0) as stream:
    kinds = [event.type for event in stream]
    final = stream.get_final_response()
assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
assert "response.output_text.delta" in kinds and "response.output_item.done" in kinds, kinds
assert final.output_text == r.output_text, (final.output_text, r.output_text)

weather = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Zurich", "Lima"]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"],
        "additionalProperties": False,
    },
    "strict": True,
}
ask = "What is the weather in Paris?"
t = client.responses.create(model=model, input=ask, tools=[weather], tool_choice="required",
                            parallel_tool_calls=False, max_output_tokens=80, temperature=0)
calls = [item for item in t.output if item.type == "function_call"]
assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id, t.output
args = json.loads(calls[0].arguments)
assert args["city"] in ("Paris", "Zurich", "Lima") and 1 <= args["days"] <= 7, args

with client.responses.stream(model=model, input=ask, tools=[weather], temperature=0, max_output_tokens=80,
                             tool_choice={"type": "function", "name": "get_weather"}) as stream:
    kinds = [event.type for event in stream]
    final = stream.get_final_response()
streamed = [item for item in final.output if item.type == "function_call"]
assert "response.function_call_arguments.delta" in kinds, kinds
assert streamed and json.loads(streamed[0].arguments) == args, (final.output, args)

# The call's output sent back: the stored conversation goes on.
follow = client.responses.create(model=model, previous_response_id=t.id, tools=[weather], tool_choice="none",
                                 input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                         "output": "Sunny, 21 C"}], max_output_tokens=8, temperature=0)
assert follow.previous_response_id == t.id and follow.output[0].type == "message", follow
assert follow.usage.input_tokens > t.usage.input_tokens, (follow.usage, t.usage)

# Retrieve and delete.
assert client.responses.retrieve(r.id).output_text == r.output_text
client.responses.delete(r.id)
try:
    client.responses.retrieve(r.id)
    raise AssertionError("a deleted response was found")
except openai.NotFoundError:
    pass
try:
    client.responses.create(model=model, previous_response_id=r.id, input="more", max_output_tokens=4)
    raise AssertionError("a deleted previous_response_id was accepted")
except openai.BadRequestError as e:
    assert e.param == "previous_response_id", (e.param, e)

# A JSON schema through text.format.
schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lima"]}},
          "required": ["city"], "additionalProperties": False}
j = client.responses.create(model=model, input="A city?", max_output_tokens=40, temperature=0,
                            text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}})
assert json.loads(j.output_text)["city"] in ("Paris", "Lima"), j.output_text

# Bad input: a 400 naming the field.
try:
    client.responses.create(model=model, max_output_tokens=4, input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}]}])
    raise AssertionError("an image was accepted")
except openai.BadRequestError as e:
    assert "input_image" in str(e), e

print("responses client: ok")

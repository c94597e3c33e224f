"""The official `anthropic` Python client against a running cluster:
messages.create, streaming, forced tool use (created and streamed),
tool results sent back, count_tokens and errors in Anthropic's shape.

Usage: python anthropic_client.py BASE_URL MODEL
The model has random weights: every tool call here is forced (tool_choice
"any" or a named tool), so the server's grammar makes it.
Exits non-zero (with a message) on the first mismatch.
"""
import sys

import anthropic

base_url, model = sys.argv[1], sys.argv[2]
# The SDK sends its key as x-api-key and adds /v1/messages itself.
client = anthropic.Anthropic(base_url=base_url, api_key="test-key", max_retries=0)
hello = [{"role": "user", "content": "Tell me a story."}]
# Recent clients dropped `temperature` from their signature (the API still
# takes it): greedy decoding, for outputs that can be compared.
greedy = {"extra_body": {"temperature": 0}}

# create: text, a stop reason, usage.
m = client.messages.create(model=model, max_tokens=12, **greedy, messages=hello,
                           system=[{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}])
assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_"), m
assert m.stop_reason in ("end_turn", "max_tokens"), m
assert m.content and m.content[0].type == "text" and m.content[0].text, m
assert m.usage.output_tokens > 0 and m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) > 0, m.usage

# The same request again: the prompt's full blocks come from the prefix cache.
again = client.messages.create(model=model, max_tokens=12, **greedy, messages=hello,
                               system="You are terse.")
assert again.content[0].text == m.content[0].text, (again, m)

# Streamed: the SDK's accumulated message equals the whole one.
with client.messages.stream(model=model, max_tokens=12, **greedy, messages=hello,
                            system="You are terse.") as stream:
    kinds = [event.type for event in stream]
    final = stream.get_final_message()
assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
assert "content_block_start" in kinds and "content_block_delta" in kinds and "message_delta" in kinds, kinds
assert final.content[0].text == m.content[0].text and final.stop_reason == m.stop_reason, (final, m)

# stop_sequences: the text ends before the sequence, which the reply names.
word = m.content[0].text.split()[0] if m.content[0].text.split() else None
if word and len(m.content[0].text) > len(word):
    cut = client.messages.create(model=model, max_tokens=12, **greedy, messages=hello, system="You are terse.",
                                 stop_sequences=[m.content[0].text[len(word):len(word) + 2]])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence, cut

# Forced tool use: the input is an object valid against the schema.
weather = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Zurich", "Lima"]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}
ask = [{"role": "user", "content": "What is the weather in Paris?"}]
t = client.messages.create(model=model, max_tokens=80, **greedy, messages=ask, tools=[weather],
                           tool_choice={"type": "any", "disable_parallel_tool_use": True})
assert t.stop_reason == "tool_use", t
uses = [b for b in t.content if b.type == "tool_use"]
assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_"), t
assert uses[0].input["city"] in ("Paris", "Zurich", "Lima") and 1 <= uses[0].input["days"] <= 7, uses[0]

# Streamed tool use: input_json_delta pieces accumulate to the same input.
with client.messages.stream(model=model, max_tokens=80, **greedy, messages=ask, tools=[weather],
                            tool_choice={"type": "tool", "name": "get_weather"}) as stream:
    final = stream.get_final_message()
streamed = [b for b in final.content if b.type == "tool_use"]
assert final.stop_reason == "tool_use" and streamed and streamed[0].input == uses[0].input, (final, t)

# The tool's result sent back: the conversation goes on.
follow = client.messages.create(model=model, max_tokens=8, **greedy, tools=[weather], messages=ask + [
    {"role": "assistant", "content": [b.model_dump() for b in t.content]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "Sunny, 21 C"}]},
], tool_choice={"type": "none"})
assert follow.content and follow.content[0].type == "text", follow

# count_tokens: the prompt as create templates it.
count = client.messages.count_tokens(model=model, messages=hello, system="You are terse.")
assert count.input_tokens == again.usage.input_tokens + (again.usage.cache_read_input_tokens or 0), (count, again)

# Errors in Anthropic's shape, with the SDK's exception types.
for bad, param in [
    (dict(model=model, max_tokens=5, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]),
     "image"),
    (dict(model="no-such-model", max_tokens=5, messages=hello), "no-such-model"),
    (dict(model=model, max_tokens=5, messages=hello, extra_body={"temperature": 7}), "temperature"),
]:
    try:
        client.messages.create(**bad)
        raise AssertionError(f"accepted: {bad}")
    except (anthropic.BadRequestError, anthropic.NotFoundError) as e:
        assert e.body["type"] == "error" and param in e.body["error"]["message"], e.body
        assert e.body["error"]["type"] in ("invalid_request_error", "not_found_error"), e.body

print("anthropic client: ok")

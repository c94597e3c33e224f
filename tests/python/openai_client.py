"""Drives a tinyvllm coordinator with the official `openai` Python client.

Usage: python openai_client.py BASE_URL MODEL
Exits non-zero (with a message) on the first mismatch.
"""
import sys

import openai
from openai import OpenAI

base_url, model = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=base_url, api_key="test-key")

models = client.models.list()
assert [m.id for m in models.data] == [model], models
# models.retrieve is GET /v1/models/{id}; an unknown id is OpenAI's 404.
assert client.models.retrieve(model).id == model
try:
    client.models.retrieve("no-such-model")
    raise AssertionError("retrieving an unknown model did not fail")
except openai.NotFoundError as e:
    assert e.body["code"] == "model_not_found", e.body

# Completions, then the same request streamed.
c = client.completions.create(model=model, prompt="Once upon a time", max_tokens=24, temperature=0)
text = c.choices[0].text
assert c.object == "text_completion" and text, c
assert c.usage.completion_tokens == 24, c.usage
assert c.choices[0].finish_reason == "length", c
stream = client.completions.create(model=model, prompt="Once upon a time", max_tokens=24, temperature=0, stream=True)
assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == text

# n and seed: two choices with one call.
c2 = client.completions.create(model=model, prompt="Once", max_tokens=8, n=2, seed=7, logprobs=2)
assert len(c2.choices) == 2 and c2.choices[0].logprobs.token_logprobs, c2

# Chat, then streamed, with usage in the last chunk.
messages = [{"role": "user", "content": "Hello!"}]
r = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
reply = r.choices[0].message.content
assert r.object == "chat.completion" and r.choices[0].message.role == "assistant" and reply, r
assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens == 16, r.usage
chunks = list(client.chat.completions.create(
    model=model, messages=messages, max_tokens=16, temperature=0, stream=True,
    stream_options={"include_usage": True}))
streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
assert streamed == reply, (streamed, reply)
assert chunks[-1].usage.completion_tokens == 16, chunks[-1]

# logit_bias as the client sends it (string keys): +100 on one token makes it every pick.
b = client.completions.create(model=model, prompt="Once", max_tokens=4, temperature=0, logprobs=0,
                              logit_bias={"100": 100})
assert len(set(b.choices[0].logprobs.tokens)) == 1, b.choices[0].logprobs

# Scoring as lm-eval's local-completions model does: token ids, echo, logprobs=1,
# max_tokens=1; the continuation's logprobs are token_logprobs[ctxlen:-1].
context = client.completions.create(model=model, prompt="Once upon a time", max_tokens=0, echo=True,
                                    logprobs=0, temperature=0).choices[0].logprobs
ctxlen = len(context.tokens)
assert context.token_logprobs[0] is None and all(lp <= 0 for lp in context.token_logprobs[1:]), context
g = client.completions.create(model=model, prompt="Once upon a time", max_tokens=5, temperature=0, logprobs=1)
scored = client.completions.create(model=model, prompt="Once upon a time" + g.choices[0].text, max_tokens=1,
                                   echo=True, logprobs=1, temperature=0).choices[0].logprobs
continuation = scored.token_logprobs[ctxlen:-1]
assert len(continuation) == 5, scored
assert all(abs(a - b) < 1e-4 for a, b in zip(continuation, g.choices[0].logprobs.token_logprobs)), (continuation, g)
assert all(lp == max(top.values()) for lp, top in zip(continuation, scored.top_logprobs[ctxlen:-1])), scored

# Logprobs as OpenAI shapes them. Completions: up to logprobs+1 top entries, the chosen token always
# among them (sampled, so it is often not the likeliest); with echo, each text_offset is where its
# token's text starts in the returned text, which starts with the prompt.
e = client.completions.create(model=model, prompt="Once upon a time, there", max_tokens=12, temperature=1.5,
                              seed=11, logprobs=1, echo=True)
lp, text = e.choices[0].logprobs, e.choices[0].text
assert text.startswith("Once upon a time, there"), text
assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset), lp
for tok, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
    if top is not None:
        assert 1 <= len(top) <= 2 and tok in top and abs(top[tok] - logprob) < 1e-4, (tok, logprob, top)
assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(text), (lp.text_offset, text)
for tok, offset in zip(lp.tokens, lp.text_offset):
    word = tok.strip()
    if word.isalpha():  # a plain word piece sits at its offset (a first word without its space)
        assert text[offset:].lstrip().startswith(word), (tok, offset, text)
upon = text.index(" upon")
assert upon in lp.text_offset, (upon, lp.text_offset)
# Chat: `top_logprobs` entries {token, logprob, bytes}, top_logprobs of them, likeliest first.
r = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                   top_logprobs=3)
for entry in r.choices[0].logprobs.content:
    assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob == entry.logprob, entry
    assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
    assert all(bytes(t.bytes).decode() == t.token for t in entry.top_logprobs), entry

# Errors come back as the client's exceptions with OpenAI's shape.
def bad_request(param, **kwargs):
    try:
        kwargs.setdefault("messages", messages)
        client.chat.completions.create(model=model, **kwargs)
    except Exception as e:  # openai.BadRequestError
        assert getattr(e, "status_code", None) == 400, e
        assert e.body["param"] == param, e.body
        return
    raise SystemExit(f"expected a 400 naming {param}")

bad_request("max_tokens", max_tokens=-1)
bad_request("max_tokens", max_tokens=100_000)  # beyond the context
bad_request("response_format", response_format={  # a schema the grammar compiler rejects
    "type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer", "minimum": 2, "maximum": 1}}})
bad_request("tools", tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])

print("openai client: ok")

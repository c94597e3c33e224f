"""Writes chat_templates.json: realistic Hugging Face chat templates rendered
by Jinja2 set up as transformers' apply_chat_template sets it up (sandboxed,
trim_blocks, lstrip_blocks, loopcontrols, its tojson/raise_exception/
strftime_now). The Rust tests render the same inputs with minijinja and expect
the same text. Run: python3 gen_chat_templates.py (needs jinja2 3.1)."""
import json
from datetime import datetime

from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

QWEN25_TOOLS = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# Llama 2 / Mistral style: no whitespace control, so trim_blocks and
# lstrip_blocks decide the output; python string methods, namespace, slicing,
# loop controls, raise_exception on bad role order.
LLAMA2_STYLE = r"""{% if messages[0]['role'] == 'system' %}
    {% set system = messages[0]['content'].strip() %}
    {% set loop_messages = messages[1:] %}
{% else %}
    {% set system = '' %}
    {% set loop_messages = messages %}
{% endif %}
{% set ns = namespace(count=0) %}
{{ bos_token }}
{% for message in loop_messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if message['content'].startswith('#skip') %}{% continue %}{% endif %}
    {% set ns.count = ns.count + 1 %}
    {% if message['role'] == 'user' %}
[INST] {% if loop.first and system %}<<SYS>>
{{ system }}
<</SYS>>

{% endif %}{{ message['content'].strip() }} [/INST]
    {% else %}
 {{ message['content'].strip() }}{{ eos_token }}
    {% endif %}
{% endfor %}
{{ ns.count }} turns, {{ strftime_now("%Y") | length }}-digit year, {{ loop_messages | map(attribute='role') | join(',') }}
"""

# Llama 3.1 style: date_string default, tools as JSON with indent.
LLAMA31_STYLE = r"""{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none %}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# Keys in sorted order throughout: the server parses requests into
# serde_json maps, which keep keys sorted.
WEATHER_TOOL = {"function": {"description": "Get the weather (°C) in a city", "name": "get_weather",
                             "parameters": {"properties": {"city": {"type": "string"}, "days": {"default": 1.5, "type": "number"}},
                                            "required": ["city"], "type": "object"}},
                "type": "function"}

CASES = [
    {"id": "qwen25_plain", "template": QWEN25_TOOLS, "bos_token": "", "eos_token": "<|im_end|>",
     "add_generation_prompt": True, "tools": None,
     "messages": [{"content": "Hi", "role": "user"}, {"content": "Hello!", "role": "assistant"}, {"content": "Bye", "role": "user"}]},
    {"id": "qwen25_tools", "template": QWEN25_TOOLS, "bos_token": "", "eos_token": "<|im_end|>",
     "add_generation_prompt": True, "tools": [WEATHER_TOOL],
     "messages": [{"content": "Be brief.", "role": "system"}, {"content": "Weather in Zürich?", "role": "user"},
                  {"content": None, "role": "assistant", "tool_calls": [
                      {"function": {"arguments": {"city": "Zürich", "days": 2}, "name": "get_weather"}, "id": "c1", "type": "function"}]},
                  {"content": "{\"temp\": 21}", "role": "tool", "tool_call_id": "c1"},
                  {"content": "{\"rain\": false}", "role": "tool", "tool_call_id": "c1"}]},
    {"id": "llama2_style", "template": LLAMA2_STYLE, "bos_token": "<s>", "eos_token": "</s>",
     "add_generation_prompt": False, "tools": None,
     "messages": [{"content": "  Be nice.  ", "role": "system"}, {"content": " Hi ", "role": "user"},
                  {"content": "Hello", "role": "assistant"}, {"content": "#skip me", "role": "user"},
                  {"content": "ok", "role": "assistant"}, {"content": "Bye\n", "role": "user"}]},
    {"id": "llama31_style", "template": LLAMA31_STYLE, "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
     "add_generation_prompt": True, "tools": [WEATHER_TOOL],
     "messages": [{"content": " What's up? ", "role": "user"}]},
]


def render(case, today=None):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def raise_exception(message):
        raise ValueError(message)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda f: today if today is not None else datetime.now().strftime(f)
    kwargs = {"messages": case["messages"], "add_generation_prompt": case["add_generation_prompt"],
              "bos_token": case["bos_token"], "eos_token": case["eos_token"]}
    if case["tools"] is not None:
        kwargs["tools"] = case["tools"]
    # chat_template_kwargs; the standard variables take precedence.
    kwargs = {**(case.get("extra") or {}), **kwargs}
    return env.from_string(case["template"]).render(**kwargs)


def main():
    for case in CASES:
        case["expected"] = render(case)
    bad = dict(CASES[2], messages=[{"content": "a", "role": "user"}, {"content": "b", "role": "user"}])
    try:
        render(bad)
        raise SystemExit("expected raise_exception")
    except ValueError as e:
        assert "alternate" in str(e)
    with open("chat_templates.json", "w", encoding="utf-8") as f:
        json.dump(CASES, f, ensure_ascii=False, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()

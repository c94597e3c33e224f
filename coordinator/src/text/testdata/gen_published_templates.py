"""Writes published_templates.json: the chat templates published with the
newer families (files in published/: Qwen3's, shared by Qwen3-30B-A3B and
the dense Qwen3 models; gpt-oss-120b's, the same as gpt-oss-20b's; GLM-4.6's,
GLM-4.5's format; as llama.cpp keeps them in models/templates/, here from the
llama-cpp-python 0.3.36 source distribution; Gemma 3's, from the
tokenizer_config.json of google/gemma-3-*-it, the same for every size) rendered by Jinja2 set up as
transformers' apply_chat_template sets it up (gen_chat_templates.render).
gpt-oss prints today's date: it is written as <today> and the Rust test puts
the date of its run there. Run: python3 gen_published_templates.py."""
import json
import runpy

render = runpy.run_path("gen_chat_templates.py", run_name="helpers")["render"]

WEATHER_TOOL = {"function": {"description": "Get the weather in a city", "name": "get_weather",
                             "parameters": {"properties": {"city": {"type": "string"}}, "required": ["city"],
                                            "type": "object"}},
                "type": "function"}
CHAT = [{"content": "Be brief.", "role": "system"}, {"content": "Hi", "role": "user"},
        {"content": "Hello!", "role": "assistant"}, {"content": "What is 2+2?", "role": "user"}]
TOOL_TURN = [{"content": "Weather in Paris?", "role": "user"},
             {"content": "", "role": "assistant", "tool_calls": [
                 {"function": {"arguments": {"city": "Paris"}, "name": "get_weather"}, "id": "c1", "type": "function"}]},
             {"content": "{\"temp\": 21}", "role": "tool", "tool_call_id": "c1"}]

CASES = [
    ("qwen3_chat", "qwen3.jinja", "", "<|im_end|>", CHAT, None, None),
    ("qwen3_no_thinking", "qwen3.jinja", "", "<|im_end|>", CHAT, None, {"enable_thinking": False}),
    ("qwen3_tools", "qwen3.jinja", "", "<|im_end|>", TOOL_TURN, [WEATHER_TOOL], None),
    ("qwen3_reasoning_history", "qwen3.jinja", "", "<|im_end|>",
     [{"content": "Hi", "role": "user"}, {"content": "<think>\nGreet back.\n</think>\n\nHello!", "role": "assistant"},
      {"content": "Bye", "role": "user"}], None, None),
    ("gpt_oss_chat", "gpt-oss.jinja", "<|startoftext|>", "<|return|>", CHAT, None, None),
    ("gpt_oss_effort", "gpt-oss.jinja", "<|startoftext|>", "<|return|>", CHAT[1:], None, {"reasoning_effort": "high"}),
    ("glm46_chat", "glm-4.6.jinja", "", "<|endoftext|>", CHAT, None, None),
    ("glm46_no_thinking", "glm-4.6.jinja", "", "<|endoftext|>", CHAT, None, {"enable_thinking": False}),
    # Gemma 3: the system prompt joins the first user turn, the assistant
    # is "model", content parts are trimmed and joined.
    ("gemma3_chat", "gemma3.jinja", "<bos>", "<eos>", CHAT, None, None),
    ("gemma3_parts", "gemma3.jinja", "<bos>", "<eos>",
     [{"content": [{"type": "text", "text": "Be brief."}], "role": "system"},
      {"content": [{"type": "text", "text": " Hi, "}, {"type": "text", "text": "there \n"}], "role": "user"}],
     None, None),
    ("glm46_parts", "glm-4.6.jinja", "", "<|endoftext|>",
     [{"content": [{"type": "text", "text": "Hi, "}, {"type": "text", "text": "there"}], "role": "user"}], None, None),
]

out = []
for (case_id, file, bos, eos, messages, tools, extra) in CASES:
    template = open(f"published/{file}", encoding="utf-8").read()
    case = {"id": case_id, "template_file": file, "bos_token": bos, "eos_token": eos,
            "add_generation_prompt": True, "tools": tools, "extra": extra, "messages": messages}
    expected = render(dict(case, template=template, extra=extra), today="<today>")
    out.append(dict(case, expected=expected))
with open("published_templates.json", "w", encoding="utf-8") as f:
    json.dump(out, f, ensure_ascii=False, indent=1)
    f.write("\n")

"""The OpenAI Agents SDK (openai-agents) running one tool-using turn
against the coordinator, over the Responses API (the SDK's default) and
over chat completions. The first model call must use the tool
(tool_choice "required", which the server forces with a grammar); the SDK
runs the tool, sends its output back, and the model answers (the SDK resets
tool_choice after a call, so the answer is free text).

Usage: agents_sdk.py <api_url> <model>"""
import asyncio
import sys
from typing import Literal

from openai import AsyncOpenAI
from pydantic import BaseModel
from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool,
                    set_tracing_disabled)

set_tracing_disabled(True)  # no network: traces would go to OpenAI

calls = []


class Report(BaseModel):
    """The agent's answer: a structured output keeps a random model's text short."""
    weather: Literal["sunny", "rainy"]


@function_tool
def get_weather(city: Literal["Paris", "Lima"]) -> str:
    """The weather in a city."""
    calls.append(city)
    return f"Sunny in {city}"


async def one_turn(model) -> None:
    calls.clear()
    agent = Agent(
        name="weather",
        instructions="Answer with the weather tool.",
        tools=[get_weather],
        output_type=Report,
        model=model,
        # One call a turn: a second one could be cut by max_tokens.
        model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=96, temperature=0.7),
    )
    result = await Runner.run(agent, "Weather in Paris?", max_turns=4)
    kinds = [type(item).__name__ for item in result.new_items]
    assert calls and calls[0] in ("Paris", "Lima"), (calls, kinds)
    assert kinds[:2] == ["ToolCallItem", "ToolCallOutputItem"], kinds
    assert isinstance(result.final_output, Report), result.final_output
    print(type(model).__name__, calls, kinds)


async def main(url: str, model: str) -> None:
    client = AsyncOpenAI(base_url=url, api_key="none")
    await one_turn(OpenAIResponsesModel(model=model, openai_client=client))
    await one_turn(OpenAIChatCompletionsModel(model=model, openai_client=client))
    print("agents sdk: ok")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))

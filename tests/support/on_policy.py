"""The stored records of on-policy conversations, made by the code that makes them in a run.

Each conversation is a prompt (a whole conversation without its final answer, as ``last_turn`` prepares it)
and the answers the target writes turn by turn. :func:`converse` drives
:class:`~datagen.generation.conversation.Conversation` with them: each turn's request is the conversation's
own (the target's earlier answers, reasoning and tool calls included, then the dataset's next user turn or its
recorded tool results spliced in after the target's equal call), and each record holds that request as the
dispatcher stores it. The conversations cover what a row's mask depends on: reasoning in earlier turns (the
Qwen3 templates re-render earlier assistant turns without it), non-thinking answers (re-rendered without their
empty think block), a tool call whose recorded result is spliced in, and a last turn cut at ``max_tokens``.
"""

from __future__ import annotations

from typing import Any

from datagen.generation.conversation import Conversation
from datagen.records import (
    AssistantCompletion,
    CompletionRecord,
    FunctionCall,
    Message,
    PromptRecord,
    SamplingParams,
    TokenUsage,
    ToolCall,
)

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
# Marks the dataset's own assistant text: no on-policy row may hold it.
DATASET_ANSWER = "DATASET ANSWER"


def _dataset_call(call_id: str, city: str) -> ToolCall:
    return ToolCall(id=call_id, function=FunctionCall(name="get_weather", arguments={"city": city}))


# name -> (the prompt's messages, its tools, the target's answer and finish reason per turn, thinking switch)
Script = tuple[list[Message], list[dict[str, Any]] | None, list[tuple[AssistantCompletion, str]], bool | None]
SCRIPTS: dict[str, Script] = {
    # Reasoning in every turn: later rows hold earlier answers whose reasoning the template drops.
    "thinking": (
        [
            Message(role="system", content="You are a patient maths tutor."),
            Message(role="user", content="What is 17 times 3?"),
            Message(role="assistant", content=f"{DATASET_ANSWER}: 51."),
            Message(role="user", content="And divided by 4?"),
            Message(role="assistant", content=f"{DATASET_ANSWER}: 12.75."),
            Message(role="user", content="Round that to the nearest whole number, please."),
        ],
        None,
        [
            (AssistantCompletion(reasoning_content="17 times 3 is 51.", content="17 · 3 = **51**."), "stop"),
            (
                AssistantCompletion(
                    reasoning_content="51 / 4 = 12.75, since 4 * 12 = 48 and 3/4 = 0.75.",
                    content="51 ÷ 4 = 12.75.",
                ),
                "stop",
            ),
            (
                AssistantCompletion(
                    reasoning_content="\n12.75 is closer to 13 than to 12.\n", content="\nIt rounds to 13.\n"
                ),
                "stop",
            ),
        ],
        None,
    ),
    # A call equal to the dataset's: the recorded result is spliced in after the target's own call (its own id),
    # the target answers after it, then the dataset's next user turn.
    "tool": (
        [
            Message(role="system", content="You may call functions."),
            Message(role="user", content="What's the weather in Paris today?"),
            Message(role="assistant", content="", tool_calls=[_dataset_call("call_dataset_0", "Paris")]),
            Message(role="tool", content='{"temp_c": 18, "sky": "sunny"}', tool_call_id="call_dataset_0"),
            Message(role="assistant", content=f"{DATASET_ANSWER}: sunny, 18 °C."),
            Message(role="user", content="Thanks! Do I need an umbrella?"),
        ],
        [WEATHER_TOOL],
        [
            (
                AssistantCompletion(
                    content="",
                    reasoning_content="The user wants Paris's weather: call the tool.",
                    tool_calls=[_dataset_call("call_target_7", "Paris")],
                ),
                "tool_calls",
            ),
            (
                AssistantCompletion(
                    reasoning_content="The tool says sunny and 18 °C.",
                    content="It is sunny in Paris, 18 °C.",
                ),
                "stop",
            ),
            (
                AssistantCompletion(reasoning_content="Sunny: no rain.", content="No umbrella needed today."),
                "stop",
            ),
        ],
        None,
    ),
    # Thinking off: earlier answers are re-rendered without the empty think block they were generated after;
    # the last turn was cut at max_tokens (kept, no end of turn trained).
    "no_thinking_truncated": (
        [
            Message(role="user", content="Name a colour."),
            Message(role="assistant", content=f"{DATASET_ANSWER}: red."),
            Message(role="user", content="Now write a long poem about it."),
        ],
        None,
        [
            (AssistantCompletion(content="Blue."), "stop"),
            (AssistantCompletion(content="Blue as the sea, blue as the sky, blue as"), "length"),
        ],
        False,
    ),
}


def converse(
    name: str, *, dataset: str = "demo", prompt_id: str | None = None, model: str = "Qwen/Qwen3-8B"
) -> list[CompletionRecord]:
    """The stored records of one scripted on-policy conversation, one per turn, in order.

    Args:
        name: Which conversation of :data:`SCRIPTS`.
        dataset: The dataset the records belong to.
        prompt_id: The prompt's id (default: ``name``).
        model: The model named on the records.

    Returns:
        Each turn's completion record: ``messages`` are that turn's request, as the run stores it.

    """
    messages, tools, answers, thinking = SCRIPTS[name]
    prompt = PromptRecord(prompt_id=prompt_id or name, dataset=dataset, messages=messages, tools=tools)
    conversation = Conversation(prompt, 0, SamplingParams(enable_thinking=thinking), None, dataset)
    assert conversation.turns == len(answers), f"{name}: {conversation.turns} turns, {len(answers)} answers"
    request = conversation.request()
    records: list[CompletionRecord] = []
    for answer, finish_reason in answers:
        assert request is not None, f"{name}: the conversation ended before turn {len(records)}"
        record = CompletionRecord(
            prompt_id=request.prompt.prompt_id,
            sample_index=request.sample_index,
            dataset=request.dataset,
            messages=request.prompt.messages,
            tools=request.prompt.tools,
            completion=answer,
            finish_reason=finish_reason,  # type: ignore[arg-type]
            usage=TokenUsage(prompt_tokens=20, completion_tokens=20),
            model=model,
            engine="sglang",
            server="http://127.0.0.1:30000",
            sampling=request.sampling,
            turn=request.turn,
            latency_s=0.5,
        )
        records.append(record)
        step = conversation.advance(record)
        assert not step.ended, f"{name}: turn {record.turn} ended the conversation: {step.ended}"
        request = step.request
    assert request is None and conversation.over
    return records


def on_policy_records(dataset: str = "demo") -> dict[str, CompletionRecord]:
    """Every turn of every scripted conversation, named ``on_policy_<conversation>_turn_<turn>``."""
    return {
        f"on_policy_{name}_turn_{record.turn}": record
        for name in SCRIPTS
        for record in converse(name, dataset=dataset)
    }

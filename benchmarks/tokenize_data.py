"""Seeded, realistic synthetic completions for the merge-and-tokenize benchmark.

Rows look like what the drafter's target produces: a system prompt on some, prompts of ~340 tokens and answers
of ~730 tokens (Qwen3 vocabulary), thinking on most rows, Python code in a third, tool definitions with a
tool-call round trip in a quarter (answers that are parallel tool calls or text after a tool response),
multi-turn histories, a few truncated rows and samples of one prompt next to each other (as generate_shard
writes them). Written as a finished run (completion shards + done markers) in a local store.

Prose comes from one of two vocabularies: ``small`` (the default: ~250 English words, uniformly; every
tokenizer-side cache hits almost always) or ``wide`` (those words plus 30,000 pseudo-words, Zipf-distributed,
and one word in 200 non-ASCII: accents, dashes, arrows, CJK), closer to what real answers cost a tokenizer.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Literal

from datagen.output.layout import RunLayout
from datagen.output.store import Store
from datagen.records import (
    AssistantCompletion,
    CompletionRecord,
    FunctionCall,
    Message,
    PromptRecord,
    SamplingParams,
    ShardSummary,
    TokenUsage,
    ToolCall,
)

_WORD_TEXT = (
    "the of and to in is that for it as with was on be by this are or at from which an have not but can all "
    "value function return list data model request server token cache memory thread process file path "
    "error result query index table column row batch shard version config option default number string "
    "first second each every other new old large small fast slow simple complex important possible "
    "because however therefore although since while until unless whether rather instead also only "
    "compute measure compare check verify update create delete read write parse render train test "
    "user assistant system tool answer question problem solution step reason example case input output "
    "array integer float boolean dictionary object class method variable loop condition branch recursion "
    "probability distribution gradient matrix vector sum product average median variance sequence "
    "Paris Berlin Tokyo London weather temperature forecast city country population history science "
    "we should first consider how the approach works then verify that edge cases are handled correctly"
)
WORDS = _WORD_TEXT.split()
CODE_TEMPLATES = [
    'def {name}({a}, {b}):\n    """Return the {what} of {a} and {b}."""\n    if not {a}:\n        return {b}\n'
    "    result = []\n    for item in {a}:\n        if item in {b}:\n            result.append(item * 2)\n"
    "    return sorted(result, key=lambda x: -x)\n",
    'class {cls}:\n    def __init__(self, {a}: int, {b}: str = "{what}") -> None:\n        self.{a} = {a}\n'
    "        self.{b} = {b}\n        self._cache: dict[str, int] = {{}}\n\n    def {name}(self) -> int:\n"
    '        key = f"{{self.{b}}}:{{self.{a}}}"\n        if key not in self._cache:\n'
    "            self._cache[key] = len(self.{b}) + self.{a} ** 2\n        return self._cache[key]\n",
    "import json\nfrom pathlib import Path\n\n\ndef {name}(path: Path) -> list[dict]:\n"
    "    rows = []\n    with path.open() as handle:\n        for line in handle:\n            record = json.loads(line)\n"
    '            if record.get("{what}") is None:\n                continue\n            rows.append(record)\n'
    "    return rows\n",
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather and a three-day forecast for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name, e.g. Paris"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_documents",
            "description": "Full-text search over the user's documents; returns the best matching passages.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "limit": {"type": "integer", "minimum": 1, "maximum": 50},
                    "filters": {"type": "object", "properties": {"year": {"type": "integer"}}},
                },
                "required": ["query"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_python",
            "description": "Execute a Python snippet in a sandbox and return stdout, stderr and the exit code.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string"}, "timeout_s": {"type": "number"}},
                "required": ["code"],
            },
        },
    },
]
SYSTEM_PROMPTS = [
    "You are a helpful assistant. Answer precisely and show your reasoning when it helps.",
    "You are an expert software engineer. Prefer clear, tested code and explain trade-offs briefly.",
]
# Words per ~token: English prose in the Qwen3 vocabulary runs at about 1.3 tokens per word.
PROMPT_WORDS = 190
REASONING_WORDS = 420
CONTENT_WORDS = 240
TRUNCATED_SHARE = 0.02
CONVERSATION_TRUNCATED_SHARE = 0.05
SAMPLES_PER_PROMPT = 2
SHARD_COMPLETIONS = 512


PSEUDO_WORDS = 30_000
NON_ASCII_SHARE = 0.005
NON_ASCII_WORDS = [
    "naïve", "café", "Straße", "façade", "résumé", "—", "→", "°C", "\u00d7", "≤", "中文", "日本語", "Ω", "✓", "“quoted”",
]  # fmt: skip
Vocabulary = Literal["small", "wide"]


class _TextRandom(random.Random):
    """A seeded generator that also carries the vocabulary prose is drawn from."""

    def __init__(self, seed: int, vocabulary: Vocabulary) -> None:
        super().__init__(seed)
        self.words = WORDS
        self.cum_weights: list[float] | None = None
        if vocabulary == "wide":
            self.words, self.cum_weights = _wide_vocabulary()

    def words_for(self, count: int) -> list[str]:
        """``count`` words of the vocabulary (the small one uniformly, the wide one Zipf-distributed)."""
        if self.cum_weights is None:
            return self.choices(self.words, k=count)
        return self.choices(self.words, cum_weights=self.cum_weights, k=count)


def _wide_vocabulary() -> tuple[list[str], list[float]]:
    """The real words first, then pseudo-words from syllables; cumulative Zipf weights (1/rank)."""
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"] + ["an", "el", "in", "or", "us", "ex"]
    maker = random.Random(1234)
    pseudo: dict[str, None] = {}
    while len(pseudo) < PSEUDO_WORDS:
        pseudo["".join(maker.choices(syllables, k=maker.randint(2, 4)))] = None
    words = [*WORDS, *pseudo]
    total = 0.0
    cum_weights = []
    for rank in range(len(words)):
        total += 1.0 / (rank + 1)
        cum_weights.append(total)
    return words, cum_weights


def _sentence(rng: random.Random, words: int) -> str:
    chosen = rng.words_for(words) if isinstance(rng, _TextRandom) else rng.choices(WORDS, k=words)
    if isinstance(rng, _TextRandom) and rng.cum_weights is not None:
        chosen = [rng.choice(NON_ASCII_WORDS) if rng.random() < NON_ASCII_SHARE else word for word in chosen]
    chosen[0] = chosen[0].capitalize()
    return " ".join(chosen) + rng.choice([".", ".", "?", "!", ":"])


def _prose(rng: random.Random, words: int) -> str:
    parts: list[str] = []
    remaining = words
    while remaining > 0:
        size = min(remaining, rng.randint(8, 22))
        parts.append(_sentence(rng, size))
        remaining -= size
    paragraphs = [" ".join(parts[i : i + 4]) for i in range(0, len(parts), 4)]
    return "\n\n".join(paragraphs)


def _identifier(rng: random.Random) -> str:
    return "_".join(rng.choices(["load", "user", "cache", "index", "merge", "parse", "rows", "batch"], k=2))


def _code(rng: random.Random) -> str:
    template = rng.choice(CODE_TEMPLATES)
    return template.format(
        name=_identifier(rng),
        a=rng.choice(["items", "values", "left"]),
        b=rng.choice(["allowed", "right", "label"]),
        cls="".join(word.capitalize() for word in _identifier(rng).split("_")),
        what=rng.choice(WORDS),
    )


def _tool_call(rng: random.Random, index: int) -> ToolCall:
    tool = rng.choice(TOOLS)["function"]
    name = tool["name"]
    arguments: dict[str, Any]
    if name == "get_weather":
        arguments = {"city": rng.choice(["Paris", "Berlin", "Tokyo"]), "unit": "celsius"}
    elif name == "search_documents":
        arguments = {"query": _sentence(rng, 6), "limit": rng.randint(3, 20), "filters": {"year": 2024}}
    else:
        arguments = {"code": _code(rng), "timeout_s": 10.0}
    return ToolCall(id=f"call_{index}", function=FunctionCall(name=name, arguments=arguments))


def _conversation(rng: random.Random, kind: str) -> tuple[list[Message], list[dict[str, Any]] | None]:
    messages: list[Message] = []
    if rng.random() < 0.5:
        messages.append(Message(role="system", content=rng.choice(SYSTEM_PROMPTS)))
    tools = TOOLS if kind == "tool" else None
    if kind == "multi_turn":
        messages.append(Message(role="user", content=_prose(rng, PROMPT_WORDS // 3)))
        messages.append(Message(role="assistant", content=_prose(rng, PROMPT_WORDS // 3)))
        messages.append(Message(role="user", content=_prose(rng, PROMPT_WORDS // 4)))
    elif kind == "code":
        request = _prose(rng, PROMPT_WORDS // 2)
        messages.append(Message(role="user", content=f"{request}\n\n```python\n{_code(rng)}{_code(rng)}```"))
    elif kind == "tool":
        messages.append(Message(role="user", content=_prose(rng, PROMPT_WORDS // 3)))
        if rng.random() < 0.6:
            calls = [_tool_call(rng, index) for index in range(rng.randint(1, 2))]
            messages.append(Message(role="assistant", content="", tool_calls=calls))
            for call in calls:
                messages.append(
                    Message(
                        role="tool", content=_prose(rng, 30), tool_call_id=call.id, name=call.function.name
                    )
                )
    else:
        messages.append(Message(role="user", content=_prose(rng, PROMPT_WORDS)))
    return messages, tools


def _completion(
    rng: random.Random, kind: str, thinking: bool, messages: list[Message]
) -> AssistantCompletion:
    reasoning = _prose(rng, REASONING_WORDS) if thinking else None
    if kind == "tool" and messages[-1].role != "tool":
        calls = [_tool_call(rng, index) for index in range(rng.randint(1, 3))]  # parallel calls
        return AssistantCompletion(content=_sentence(rng, 12), reasoning_content=reasoning, tool_calls=calls)
    words = CONTENT_WORDS if thinking else CONTENT_WORDS + REASONING_WORDS
    content = _prose(rng, words)
    if kind == "code":
        content = f"{_prose(rng, words // 2)}\n\n```python\n{_code(rng)}{_code(rng)}```\n\n{_prose(rng, 30)}"
    return AssistantCompletion(content=content, reasoning_content=reasoning)


def make_completions(count: int, seed: int, vocabulary: Vocabulary = "small") -> list[CompletionRecord]:
    """``count`` completions (``SAMPLES_PER_PROMPT`` per prompt), the same for the same seed.

    Args:
        count: Completions to make.
        seed: Seed of every choice.
        vocabulary: ``small`` or ``wide`` (see the module docstring).

    Returns:
        The records, samples of one prompt next to each other.

    """
    rng = _TextRandom(seed, vocabulary)
    records: list[CompletionRecord] = []
    prompt_index = 0
    while len(records) < count:
        kind = rng.choices(["chat", "code", "tool", "multi_turn"], weights=[35, 30, 25, 10])[0]
        thinking = rng.random() < 0.75
        messages, tools = _conversation(rng, kind)
        dataset = {"chat": "chat", "code": "code", "tool": "agent", "multi_turn": "chat"}[kind]
        for sample in range(SAMPLES_PER_PROMPT):
            completion = _completion(rng, kind, thinking, messages)
            finish = "tool_calls" if completion.tool_calls else "stop"
            if rng.random() < TRUNCATED_SHARE:
                finish = "length"
            records.append(
                CompletionRecord(
                    prompt_id=f"{dataset}-{prompt_index:07d}",
                    sample_index=sample,
                    dataset=dataset,
                    messages=messages,
                    tools=tools,
                    completion=completion,
                    finish_reason=finish,  # type: ignore[arg-type]
                    usage=TokenUsage(prompt_tokens=340, completion_tokens=730),
                    model="Qwen/Qwen3.6-27B",
                    engine="sglang",
                    server="http://127.0.0.1:30000",
                    sampling=SamplingParams(enable_thinking=None if thinking else False),
                    latency_s=12.5,
                )
            )
            if len(records) == count:
                break
        prompt_index += 1
    return records


def _conversation_prompt(rng: random.Random, index: int) -> PromptRecord:
    """A multi-turn conversation (2-3 user turns, a tool round trip in a third) ending with a user turn."""
    messages: list[Message] = []
    if rng.random() < 0.5:
        messages.append(Message(role="system", content=rng.choice(SYSTEM_PROMPTS)))
    tools = TOOLS if rng.random() < 0.35 else None
    for turn in range(rng.randint(2, 3)):
        messages.append(Message(role="user", content=_prose(rng, PROMPT_WORDS // 3)))
        if tools and turn == 0:
            calls = [_tool_call(rng, call) for call in range(rng.randint(1, 2))]
            messages.append(Message(role="assistant", content="", tool_calls=calls))
            for call in calls:
                messages.append(Message(role="tool", content=_prose(rng, 30), tool_call_id=call.id))
        messages.append(Message(role="assistant", content=f"DATASET ANSWER {_sentence(rng, 8)}"))
    return PromptRecord(prompt_id=f"conv-{index:07d}", dataset="chat", messages=messages[:-1], tools=tools)


def make_conversations(count: int, seed: int, vocabulary: Vocabulary = "small") -> list[CompletionRecord]:
    """Every turn's record of ``count`` on-policy conversations, made by datagen's own ``Conversation``.

    Each turn's request holds the target's earlier answers (reasoning on 75% of conversations) and the dataset's
    next user turn, or its recorded tool results spliced in after the target's equal calls; the last turn is cut
    at ``max_tokens`` in ``CONVERSATION_TRUNCATED_SHARE`` of conversations.

    Args:
        count: Conversations to make (one sample each).
        seed: Seed of every choice.
        vocabulary: ``small`` or ``wide`` (see the module docstring).

    Returns:
        The records, conversation by conversation, turns in order (as an on-policy shard stores them).

    """
    from datagen.generation.conversation import Conversation

    rng = _TextRandom(seed, vocabulary)
    records: list[CompletionRecord] = []
    for index in range(count):
        prompt = _conversation_prompt(rng, index)
        thinking = rng.random() < 0.75
        conversation = Conversation(
            prompt, 0, SamplingParams(enable_thinking=None if thinking else False), None, prompt.dataset
        )
        request = conversation.request()
        while request is not None:
            turn = conversation.next_turn
            reasoning = _prose(rng, REASONING_WORDS // 3) if thinking else None
            calls = conversation.cut.dataset_calls[turn] if turn < len(conversation.cut.segments) else []
            if calls:
                # The target makes the dataset's calls (its own ids), so the recorded results are spliced in.
                answer = AssistantCompletion(
                    content="",
                    reasoning_content=reasoning,
                    tool_calls=[
                        call.model_copy(update={"id": f"target_{turn}_{n}"}) for n, call in enumerate(calls)
                    ],
                )
                finish = "tool_calls"
            else:
                answer = AssistantCompletion(
                    content=_prose(rng, CONTENT_WORDS // 3), reasoning_content=reasoning
                )
                finish = "stop"
                if turn == conversation.turns - 1 and rng.random() < CONVERSATION_TRUNCATED_SHARE:
                    finish = "length"
            record = CompletionRecord(
                prompt_id=prompt.prompt_id,
                sample_index=0,
                dataset=prompt.dataset,
                messages=request.prompt.messages,
                tools=request.prompt.tools,
                completion=answer,
                finish_reason=finish,  # type: ignore[arg-type]
                usage=TokenUsage(prompt_tokens=340, completion_tokens=240),
                model="Qwen/Qwen3.6-27B",
                engine="sglang",
                server="http://127.0.0.1:30000",
                sampling=request.sampling,
                turn=request.turn,
                latency_s=5.0,
            )
            records.append(record)
            request = conversation.advance(record).request
    return records


def write_run(root: Path, run_id: str, count: int, seed: int, vocabulary: Vocabulary = "small") -> RunLayout:
    """Write ``count`` completions as a finished run under ``root`` (shards of ``SHARD_COMPLETIONS``).

    Args:
        root: Output store root (a local folder).
        run_id: The run id.
        count: Completions to write.
        seed: Seed of the data.
        vocabulary: ``small`` or ``wide`` (see the module docstring).

    Returns:
        The run's layout.

    """
    store = Store(str(root))
    layout = RunLayout(run_id)
    records = make_completions(count, seed, vocabulary)
    for index, start in enumerate(range(0, count, SHARD_COMPLETIONS)):
        chunk = records[start : start + SHARD_COMPLETIONS]
        dataset = "mixed"
        store.write_jsonl(layout.completions(dataset, index), chunk)
        store.write_jsonl(layout.failures(dataset, index), [])
        summary = ShardSummary(
            dataset=dataset,
            shard_index=index,
            requests=len(chunk),
            completions=len(chunk),
            failures=0,
            prompt_tokens=0,
            completion_tokens=0,
            generation_s=1.0,
            completions_path=layout.completions(dataset, index),
            failures_path=layout.failures(dataset, index),
        )
        store.write_json(layout.shard_done(dataset, index), summary)
    return layout

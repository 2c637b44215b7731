"""On-policy conversations: turns cut where the target answers, each request's history the target's own answers,
a chain that ends counted per turn, a resume that continues after the last stored turn, and the dispatcher
admitting a conversation's next turn the moment the previous one lands."""

from __future__ import annotations

import functools
import itertools
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest

from datagen.config import GenerationConfig, RunConfig, parse_run_config
from datagen.dataset.tokenizer import load_tokenizer
from datagen.engines import exact_tokens_enabled
from datagen.generation.conversation import Conversation, ConversationChains
from datagen.generation.dispatch_state import GenerationResult
from datagen.generation.dispatcher import Dispatcher
from datagen.generation.failures import FailureKind, is_retryable, retried_keys
from datagen.generation.openai_chat import GenerationRequest, PromptTokens
from datagen.generation.sglang_generate import PromptEncoder, attach_prompt_tokens
from datagen.generation.shard import ShardInbox, generate_shard
from datagen.output.layout import RunLayout
from datagen.output.store import Store
from datagen.records import (
    AssistantCompletion,
    CompletionRecord,
    FailureRecord,
    FinishReason,
    FunctionCall,
    Message,
    PromptRecord,
    PromptShardRef,
    SamplingParams,
    TokenUsage,
    ToolCall,
)
from tests.support.fault_server import FaultPlan, FaultServer
from tests.support.qwen import tokenizer_with_template


def _prompt(prompt_id: str, *turns: tuple[str, str]) -> PromptRecord:
    return PromptRecord(
        prompt_id=prompt_id,
        dataset="chat",
        messages=[Message(role=role, content=content) for role, content in turns],  # type: ignore[arg-type]
    )


THREE_TURNS = _prompt(
    "conv",
    ("system", "Be brief."),
    ("user", "Q1"),
    ("assistant", "dataset answer 1"),
    ("user", "Q2"),
    ("assistant", "dataset answer 2"),
    ("user", "Q3"),
)


def _conversation(prompt: PromptRecord = THREE_TURNS, seed: int | None = None) -> Conversation:
    return Conversation(prompt, 0, SamplingParams(max_tokens=8, seed=seed), "cold", "chat")


def _answer(request: GenerationRequest, content: str, finish: FinishReason = "stop") -> CompletionRecord:
    return CompletionRecord(
        prompt_id=request.prompt.prompt_id,
        sample_index=request.sample_index,
        turn=request.turn,
        dataset=request.dataset,
        messages=request.prompt.messages,
        completion=AssistantCompletion(content=content),
        finish_reason=finish,
        usage=TokenUsage(),
        model="m",
        engine="external",
        server="http://s",
        sampling=request.sampling,
        latency_s=0.1,
    )


def _failure(request: GenerationRequest, kind: FailureKind) -> FailureRecord:
    return FailureRecord(
        prompt_id=request.prompt.prompt_id,
        sample_index=request.sample_index,
        turn=request.turn,
        dataset=request.dataset,
        reason="boom",
        error_type=kind.value,
        attempts=3,
    )


def _texts(messages: list[Message]) -> list[tuple[str, str | None]]:
    return [(message.role, message.content) for message in messages]


def test_each_turns_history_is_the_targets_own_earlier_answers_then_the_datasets_next_user_turn() -> None:
    conversation = _conversation(seed=7)
    assert conversation.turns == 3
    first = conversation.request()
    assert first.turn == 0 and first.key == "conv/0/0"
    assert _texts(first.prompt.messages) == [("system", "Be brief."), ("user", "Q1")]
    second = conversation.advance(_answer(first, "mine 1")).request
    assert second is not None and second.turn == 1
    assert _texts(second.prompt.messages) == [
        ("system", "Be brief."),
        ("user", "Q1"),
        ("assistant", "mine 1"),
        ("user", "Q2"),
    ]
    third = conversation.advance(_answer(second, "mine 2")).request
    assert third is not None
    assert _texts(third.prompt.messages)[-3:] == [("user", "Q2"), ("assistant", "mine 2"), ("user", "Q3")]
    assert "dataset answer" not in str(third.prompt.messages)
    assert len({first.sampling.seed, second.sampling.seed, third.sampling.seed}) == 3, (
        "each turn its own seed"
    )
    assert third.sampling_setting == "cold"
    last = conversation.advance(_answer(third, "mine 3"))
    assert last.request is None and not last.ended and conversation.over


def test_a_failed_turn_ends_its_conversation_with_one_conversation_ended_failure_per_turn_never_sent() -> (
    None
):
    conversation = _conversation()
    first = conversation.request()
    step = conversation.advance(_failure(first, FailureKind.RETRIES_EXHAUSTED))
    assert step.request is None
    assert [(f.turn, f.error_type) for f in step.ended] == [
        (1, "conversation_ended"),
        (2, "conversation_ended"),
    ]
    assert step.ended[0].reason == "turn 0 failed: retries_exhausted"
    assert not is_retryable(step.ended[0]), "a turn with no history to send is not sent again on its own"
    # A retry round sends the failed turn again, and with it the turns its failure ended.
    failed = _failure(first, FailureKind.RETRIES_EXHAUSTED)
    assert retried_keys([*step.ended, failed]) == {"conv/0/0", "conv/0/1", "conv/0/2"}
    refused = _conversation()
    own = _failure(refused.request(), FailureKind.HTTP_STATUS).model_copy(update={"error_type": "http_400"})
    assert retried_keys([own, *refused.advance(own).ended]) == set(), "the prompt's own failure stays"


def test_an_answer_cut_at_max_tokens_ends_the_conversation_and_names_why() -> None:
    conversation = _conversation()
    step = conversation.advance(_answer(conversation.request(), "cut", finish="length"))
    assert [f.turn for f in step.ended] == [1, 2]
    assert step.ended[0].reason == "turn 0 ended with finish_reason length"
    assert retried_keys(step.ended) == set(), "a cut answer is stored: no retry round sends its turns"


def test_an_unfinished_turn_hands_back_the_rest_unfinished_so_the_next_attempt_sends_them() -> None:
    conversation = _conversation()
    step = conversation.advance(_failure(conversation.request(), FailureKind.NO_LIVE_SERVERS))
    assert [(f.turn, f.error_type) for f in step.ended] == [(1, "no_live_servers"), (2, "no_live_servers")]


def test_a_resume_continues_after_the_last_stored_turn_with_the_stored_answers_as_history() -> None:
    before = _conversation()
    first = before.request()
    stored_first = _answer(first, "stored 1")
    second = before.advance(stored_first).request
    assert second is not None
    stored: dict[str, GenerationResult] = {stored_first.key: stored_first}

    resumed = _conversation()
    step = resumed.replay(stored)
    assert step.request is not None and step.request.turn == 1
    assert step.request.prompt.messages == second.prompt.messages

    stored_second = _answer(step.request, "stored 2", finish="length")
    stored[stored_second.key] = stored_second
    again = _conversation().replay(stored)
    assert again.request is None
    assert [f.turn for f in again.ended] == [2], "the ended turn a crash left unstored is stored now"
    ended = again.ended[0]
    stored[ended.key] = ended
    finished = _conversation().replay(stored)
    assert finished.request is None and not finished.ended


def _call(name: str, call_id: str | None = None, **arguments: object) -> ToolCall:
    return ToolCall(id=call_id, function=FunctionCall(name=name, arguments=arguments))


# The Hermes layout: parallel calls, results in the same order; the dataset's calls carry ids here.
TOOL_PROMPT = PromptRecord(
    prompt_id="tools",
    dataset="fc",
    messages=[
        Message(role="system", content="Use the tools."),
        Message(role="user", content="Apple and Microsoft?"),
        Message(
            role="assistant",
            tool_calls=[_call("price", "d1", ticker="AAPL"), _call("price", "d2", ticker="MSFT")],
        ),
        Message(role="tool", content="AAPL 200", tool_call_id="d1"),
        Message(role="tool", content="MSFT 400", tool_call_id="d2"),
        Message(role="assistant", content="Apple 200, Microsoft 400."),
        Message(role="user", content="And the sum?"),
    ],
    tools=[{"type": "function", "function": {"name": "price", "parameters": {"type": "object"}}}],
)


def _tool_answer(request: GenerationRequest, calls: list[ToolCall]) -> CompletionRecord:
    record = _answer(request, "", finish="tool_calls")
    return record.model_copy(update={"completion": AssistantCompletion(tool_calls=calls)})


def test_the_recorded_tool_results_are_spliced_in_after_the_targets_matching_calls_in_any_order() -> None:
    conversation = Conversation(TOOL_PROMPT, 0, SamplingParams(), None, "fc")
    assert conversation.turns == 3
    first = conversation.request()
    assert _texts(first.prompt.messages) == [("system", "Use the tools."), ("user", "Apple and Microsoft?")]
    assert first.prompt.tools == TOOL_PROMPT.tools
    mine = [_call("price", "t-b", ticker="MSFT"), _call("price", "t-a", ticker="AAPL")]
    second = conversation.advance(_tool_answer(first, mine)).request
    assert second is not None
    called, *results = second.prompt.messages[2:]
    assert called.role == "assistant" and called.tool_calls == mine
    assert [(m.role, m.content, m.tool_call_id) for m in results] == [
        ("tool", "AAPL 200", "t-a"),
        ("tool", "MSFT 400", "t-b"),
    ], "each result names the target's call it answers"
    third = conversation.advance(_answer(second, "Both priced.")).request
    assert third is not None
    assert _texts(third.prompt.messages)[-2:] == [("assistant", "Both priced."), ("user", "And the sum?")]


@pytest.mark.parametrize(
    ("calls", "reason"),
    [
        ([_call("price", ticker="AAPL")], "turn 0 called price where the dataset called price, price"),
        ([_call("price", ticker="AAPL"), _call("price", ticker="IBM")], "turn 0 called price, price where"),
        ([], "turn 0 called no tool where the dataset called price, price"),
    ],
)
def test_a_target_that_calls_other_tools_than_the_dataset_ends_the_conversation_counted_as_diverged(
    calls: list[ToolCall], reason: str
) -> None:
    conversation = Conversation(TOOL_PROMPT, 0, SamplingParams(), None, "fc")
    first = conversation.request()
    answer = _tool_answer(first, calls) if calls else _answer(first, "I will not call anything.")
    step = conversation.advance(answer)
    assert step.request is None
    assert [(f.turn, f.error_type) for f in step.ended] == [
        (1, "tool_call_diverged"),
        (2, "tool_call_diverged"),
    ]
    assert step.ended[0].reason.startswith(reason)


def test_a_tool_call_where_the_dataset_answered_ends_the_conversation_counted_as_diverged() -> None:
    conversation = _conversation()
    step = conversation.advance(_tool_answer(conversation.request(), [_call("search", q="x")]))
    assert [f.error_type for f in step.ended] == ["tool_call_diverged", "tool_call_diverged"]
    assert step.ended[0].reason == "turn 0 called search where the dataset's assistant called no tool"


def test_the_dispatcher_admits_each_next_turn_as_the_previous_lands_and_keeps_every_chain_in_order() -> None:
    prompts = [
        _prompt(
            f"c{i}",
            ("user", f"c{i} q0"),
            ("assistant", "x"),
            ("user", f"c{i} q1"),
            ("assistant", "y"),
            ("user", f"c{i} q2"),
        )
        for i in range(12)
    ]
    chains = ConversationChains(
        Conversation(prompt, 0, SamplingParams(max_tokens=8), None, "chat") for prompt in prompts
    )
    got: dict[str, list[GenerationResult]] = defaultdict(list)
    done = threading.Event()
    expected = len(chains.keys())
    count = [0]

    def deliver(_request: GenerationRequest, result: GenerationResult) -> None:
        got[result.prompt_id].append(result)
        count[0] += 1
        if count[0] == expected:
            done.set()

    first, ended = chains.resume({})
    assert len(first) == 12 and not ended
    generation = GenerationConfig(backoff_initial_s=0.01, request_timeout_s=10)
    with (
        FaultServer(FaultPlan(base_delay_s=0.05)) as server,
        Dispatcher(
            [server.url], model="m", engine="external", max_inflight_per_server=4, generation=generation
        ) as dispatcher,
    ):
        broken: list[BaseException] = []
        dispatcher.submit_stream(first, deliver, follow=chains.follower(deliver, broken.append))
        assert done.wait(60)
        assert not broken
        assert server.max_in_flight == 4, "chains interleave: every slot stays busy"
    for prompt in prompts:
        results = got[prompt.prompt_id]
        assert [r.turn for r in results] == [0, 1, 2]
        assert all(isinstance(r, CompletionRecord) for r in results)
        last = results[-1]
        assert isinstance(last, CompletionRecord)
        # The stand-in server answers "echo: <last message>": the history holds exactly those answers.
        pid = prompt.prompt_id
        assert _texts(last.messages) == [
            ("user", f"{pid} q0"),
            ("assistant", f"echo: {pid} q0"),
            ("user", f"{pid} q1"),
            ("assistant", f"echo: {pid} q1"),
            ("user", f"{pid} q2"),
        ]


def test_on_policy_datasets_take_the_engines_exact_token_mode() -> None:
    data = {
        "model": {"path": "/models/m"},
        "fleet": {"engine": "sglang"},
        "datasets": [{"name": "chat", "format": "openai_messages", "path": "x", "multi_turn": "on_policy"}],
        "output": "/tmp/out",
    }
    assert exact_tokens_enabled(parse_run_config(data)) is True
    assert exact_tokens_enabled(parse_run_config({**data, "generation": {"exact_tokens": False}})) is False


def test_a_next_turn_that_cannot_be_built_stops_the_shard_waiting_for_it_instead_of_hanging() -> None:
    # A bug while building a later turn (here: the exact-token render raising something unexpected) is not a
    # turn's failure: the shard waiting for that conversation's turns must stop, keeping what it took.
    prompt = _prompt("c0", ("user", "q0"), ("assistant", "x"), ("user", "q1"))

    def prepare(
        requests: list[GenerationRequest], previous: list[PromptTokens | None] | None
    ) -> tuple[list[GenerationRequest], list[FailureRecord]]:
        if any(request.turn for request in requests):
            raise ValueError("render exploded")
        return requests, []

    chains = ConversationChains(
        [Conversation(prompt, 0, SamplingParams(max_tokens=8), None, "chat")], prepare
    )
    first, _ = chains.resume({})
    inbox = ShardInbox(len(chains.keys()), 1)
    generation = GenerationConfig(backoff_initial_s=0.01, request_timeout_s=10)
    with (
        FaultServer(FaultPlan(base_delay_s=0.01)) as server,
        Dispatcher(
            [server.url], model="m", engine="external", max_inflight_per_server=4, generation=generation
        ) as dispatcher,
    ):
        dispatcher.submit_stream(first, inbox.put, follow=chains.follower(inbox.put, inbox.fail))
        taken: list[GenerationResult] = []
        deadline = time.monotonic() + 30
        with pytest.raises(RuntimeError, match="next turn could not be built: ValueError"):
            while time.monotonic() < deadline:
                taken += [result for _, result in inbox.take(0.5)]
                inbox.raise_if_broken()
    assert [(r.turn, isinstance(r, CompletionRecord)) for r in taken] == [(0, True)], "turn 0 is kept"


def test_a_later_turn_the_template_cannot_render_fails_unsent_and_ends_the_rest_of_its_conversation(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # Exact-token mode renders each turn when the turn before lands. The first turn renders; the second's
    # history holds the dataset's mid-conversation system message, which the Qwen3.6 template refuses.
    tokenizer = load_tokenizer(str(tokenizer_with_template(tiny_model_dir, tmp_path / "qwen3.6", "qwen3.6")))
    prompt = _prompt(
        "mid-system",
        ("user", "Q1"),
        ("assistant", "dataset answer 1"),
        ("system", "From now on, answer in French."),
        ("user", "Q2"),
        ("assistant", "dataset answer 2"),
        ("user", "Q3"),
    )
    prepare = functools.partial(attach_prompt_tokens, encoder=PromptEncoder.from_tokenizer(tokenizer))
    chains = ConversationChains([_conversation(prompt)], prepare)
    (first,), nothing_ended = chains.resume({})
    assert not nothing_ended and first.turn == 0 and first.prompt_tokens is not None
    delivered: list[tuple[int, FailureRecord]] = []
    broken: list[BaseException] = []

    def deliver(request: GenerationRequest, result: GenerationResult) -> None:
        assert isinstance(result, FailureRecord), "only the turns never sent are handed on"
        delivered.append((request.turn, result))

    follow = chains.follower(deliver, broken.append)

    assert follow(first, _answer(first, "target answer 1")) is None  # no turn left to send

    assert not broken
    assert [(turn, result.turn, result.error_type, result.attempts) for turn, result in delivered] == [
        (1, 1, "unrenderable_prompt", 0),
        (1, 2, "conversation_ended", 0),
    ]
    assert "System message must be at the beginning" in delivered[0][1].reason
    assert delivered[1][1].reason.startswith("turn 1 failed: unrenderable_prompt")


def test_a_shards_progress_counts_each_conversation_as_its_last_turn_lands_not_when_the_shard_ends(
    tmp_path: Path,
) -> None:
    layout = RunLayout("live")
    store = Store(str(tmp_path / "out"))
    prompts = [
        _prompt(
            f"c{i}", ("user", "q0"), ("assistant", "x"), ("user", "q1"), ("assistant", "y"), ("user", "q2")
        )
        for i in range(6)
    ]
    store.write_jsonl(layout.prompt_shard("chat", 0), prompts)
    shard = PromptShardRef(dataset="chat", shard_index=0, path=layout.prompt_shard("chat", 0), prompts=6)
    config = RunConfig.model_validate(
        {
            "model": {"path": "/models/m"},
            "fleet": {"engine": "external", "external_urls": ["http://127.0.0.1:9"]},
            "datasets": [
                {"name": "chat", "format": "openai_messages", "path": "x", "multi_turn": "on_policy"}
            ],
            "output": str(tmp_path / "out"),
            "generation": {"checkpoint_every": 2, "backoff_initial_s": 0.01, "request_timeout_s": 10},
        }
    )
    reports: list[tuple[int, int, int | None]] = []
    with (
        FaultServer(FaultPlan(base_delay_s=0.02)) as server,
        Dispatcher(
            [server.url],
            model="m",
            engine="external",
            max_inflight_per_server=2,
            generation=config.generation,
        ) as dispatcher,
    ):
        summary = generate_shard(
            store,
            layout,
            config,
            shard,
            dispatcher,
            progress=lambda done, total, conversations: reports.append((done, total, conversations)),
        )

    assert summary.conversations == 6 and summary.completions == 18
    assert reports[0] == (0, 18, 0) and reports[-1] == (18, 18, 6)
    assert all(a[0] <= b[0] and (a[2] or 0) <= (b[2] or 0) for a, b in itertools.pairwise(reports))
    # Conversations are counted while the shard still generates: two slots, so some end before the others.
    assert any(0 < (conversations or 0) < 6 and done < 18 for done, _, conversations in reports), reports

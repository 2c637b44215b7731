"""Records that cross a boundary: prompts, completions, failures, shard summaries.

Every record is a versioned pydantic model written as one JSON line. docs/records.md documents the
schema; change both together and bump ``schema_version`` on incompatible changes.
"""

from __future__ import annotations

import datetime as dt
import hashlib
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field

RECORD_SCHEMA_VERSION: Final = 1

Role = Literal["system", "user", "assistant", "tool"]
FinishReason = Literal["stop", "length", "tool_calls", "abort", "content_filter", "unknown"]

# Derived seeds stay below 2**31: some engines parse a seed as a signed 32-bit int.
SEED_MODULUS: Final = 2**31


def utc_now() -> dt.datetime:
    """The current time, timezone-aware UTC (every timestamp datagen writes)."""
    return dt.datetime.now(dt.UTC)


class Record(BaseModel):
    """Base of every record: unknown fields are rejected so schema drift is caught on read."""

    model_config = ConfigDict(extra="forbid")


class SamplingParams(BaseModel):
    """Sampling parameters of one request; per-dataset overrides are merged over the run defaults.

    Part of the run config (``sampling``) and of every completion record, so it lives with the records.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    temperature: float = Field(default=0.7, ge=0)
    top_p: float = Field(default=0.95, gt=0, le=1)
    top_k: int | None = Field(default=None, gt=0)
    min_p: float | None = Field(default=None, ge=0, le=1)
    max_tokens: int = Field(default=2048, gt=0)
    enable_thinking: bool | None = Field(
        default=None, description="Passed as chat_template_kwargs.enable_thinking; template default if unset."
    )
    samples_per_prompt: int = Field(default=1, gt=0, le=64)
    seed: int | None = None

    def seeded_for(self, *key: object) -> SamplingParams:
        """These parameters with a seed derived from the run's seed and ``key`` (None stays None).

        Every request (key: prompt id, sample index; a conversation's turn adds its turn) then draws its own
        sample, the same one on every attempt of the run.
        """
        if self.seed is None:
            return self
        digest = hashlib.sha256("/".join(map(str, (self.seed, *key))).encode()).digest()
        return self.model_copy(update={"seed": int.from_bytes(digest[:8], "big") % SEED_MODULUS})


class FunctionCall(Record):
    """The function part of a tool call; ``arguments`` is always a dict (parsed from JSON if needed)."""

    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class ToolCall(Record):
    """One structured tool call made by an assistant turn."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Record):
    """One neutral chat message (OpenAI style), the form every dataset row is normalised to."""

    role: Role
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def to_chat_dict(self) -> dict[str, Any]:
        """The message as a chat-template / OpenAI-API dict, without unset fields."""
        data: dict[str, Any] = {
            "role": self.role,
            "content": self.content if self.content is not None else "",
        }
        if self.reasoning_content:
            data["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            data["tool_calls"] = [call.model_dump(exclude_none=True) for call in self.tool_calls]
        if self.tool_call_id:
            data["tool_call_id"] = self.tool_call_id
        if self.name:
            data["name"] = self.name
        return data


class PromptRecord(Record):
    """One prompt to answer: messages ending with the turn the model must answer, plus tools.

    Attributes:
        prompt_id: Stable id derived from the normalised content (same prompt, same id, any run).
        source_index: Row number in the source, for tracing a prompt back to its dataset row.
    """

    schema_version: Literal[1] = RECORD_SCHEMA_VERSION
    prompt_id: str
    dataset: str
    messages: list[Message] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    source_index: int | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)


class TokenUsage(Record):
    """Token counts reported by the engine for one request."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int | None = None


class AssistantCompletion(Record):
    """What the target model generated for one request."""

    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None
    output_token_ids: list[int] | None = Field(
        default=None,
        description="Exact generated token ids, when the engine returns them (SGLang /generate).",
    )


class CompletionRecord(Record):
    """One successful generation, everything needed to train on it and to trace it."""

    schema_version: Literal[1] = RECORD_SCHEMA_VERSION
    prompt_id: str
    sample_index: int = 0
    dataset: str
    messages: list[Message]
    tools: list[dict[str, Any]] | None = None
    completion: AssistantCompletion
    finish_reason: FinishReason
    usage: TokenUsage
    model: str
    engine: str
    server: str
    sampling: SamplingParams
    sampling_setting: str | None = Field(
        default=None, description="The dataset's sampling_mix setting the prompt drew; None without a mix."
    )
    turn: int | None = Field(
        default=None,
        ge=0,
        description="An on-policy conversation's turn (0: the first answer); None otherwise.",
    )
    attempts: int = 1
    latency_s: float
    created_at: dt.datetime = Field(default_factory=utc_now)

    @property
    def key(self) -> str:
        """The request key, unique within a run: ``<prompt_id>/<sample_index>`` (``/<turn>`` for a conversation's)."""
        return request_key(self.prompt_id, self.sample_index, self.turn)


class FailureRecord(Record):
    """A request that failed for good; counted in the report, never silently dropped."""

    schema_version: Literal[1] = RECORD_SCHEMA_VERSION
    prompt_id: str
    sample_index: int = 0
    dataset: str
    reason: str
    error_type: str
    attempts: int
    last_status: int | None = None
    server: str | None = None
    turn: int | None = Field(
        default=None,
        ge=0,
        description="An on-policy conversation's turn (0: the first answer); None otherwise.",
    )
    created_at: dt.datetime = Field(default_factory=utc_now)

    @property
    def key(self) -> str:
        """The request key, unique within a run: ``<prompt_id>/<sample_index>`` (``/<turn>`` for a conversation's)."""
        return request_key(self.prompt_id, self.sample_index, self.turn)


class PromptShardRef(Record):
    """Where one written prompt shard lives and how many prompts it holds."""

    dataset: str
    shard_index: int
    path: str
    prompts: int
    turns: int | None = Field(
        default=None,
        description="On-policy conversations: the turns of its prompts (each a request per sample); None: a "
        "request per prompt and sample.",
    )

    @property
    def requests_per_sample(self) -> int:
        """Requests one sample of every prompt of the shard makes: its turns, else its prompts."""
        return self.prompts if self.turns is None else self.turns


class PreparedDataset(Record):
    """What prepare_prompts produced for one dataset."""

    dataset: str
    rows_read: int
    prompts: int
    rejections: dict[str, int] = Field(default_factory=dict)
    rejection_samples: list[dict[str, Any]] = Field(default_factory=list)
    shards: list[PromptShardRef] = Field(default_factory=list)


class DatasetMix(Record):
    """One dataset's place in the mix: its quota and what it fell short by (:mod:`datagen.prompts.mix`)."""

    dataset: str
    category: str
    quota: int | None
    prompts: int
    shortfall: int


class MixRow(Record):
    """One category of the mix table: target, new data, existing corpus, and the two together.

    Prompt columns measure the prepared prompts against the plan; row columns measure training rows
    (tokenized completions, the unit of the existing corpus's counts). Built by
    :func:`datagen.prompts.mix.mix_table`, shown by the run report.
    """

    category: str
    target_prompts: int | None = Field(description="Planned prompts (sum of the quotas); None: no quota.")
    target_share: float | None = Field(description="Planned share of the new prompts.")
    prompts: int = Field(description="New prompts prepared.")
    prompt_share: float
    shortfall: int = Field(description="Planned prompts the datasets could not supply.")
    rows: int = Field(description="New training rows (tokenized).")
    row_share: float
    existing_rows: int = Field(description="Rows of this category in the existing corpus (config).")
    combined_rows: int
    combined_share: float = Field(description="Share of existing + new rows.")


class GenerationCounts(Record):
    """What generation did with a set of requests: one shard's (its summary) or summed over shards (the report)."""

    requests: int = Field(default=0, description="Requests of the prompts (prompts x samples).")
    completions: int = Field(default=0, description="Requests that ended in a completion.")
    failures: int = Field(default=0, description="Requests that failed for good (stored as failure records).")
    prompt_tokens: int = Field(
        default=0, description="Prompt tokens of the completions, as the server counted."
    )
    completion_tokens: int = Field(default=0, description="Output tokens of the completions.")
    resent_requests: int = Field(
        default=0,
        description="Requests sent again because an earlier attempt of their shard was interrupted.",
    )
    retried_attempts: int = Field(default=0, description="Extra attempts spent on transient errors.")
    finish_reasons: dict[str, int] = Field(default_factory=dict, description="Completions by finish reason.")
    failure_reasons: dict[str, int] = Field(default_factory=dict, description="Failures by reason.")
    conversations: int = Field(
        default=0,
        description="On-policy conversations (prompts x samples); each turn is one of the requests.",
    )
    conversations_completed: int = Field(
        default=0, description="On-policy conversations whose every turn ended in a completion."
    )
    sampling_settings: dict[str, int] = Field(
        default_factory=dict,
        description="Completions by the sampling_mix setting they drew (datasets with a mix).",
    )

    def add(self, other: GenerationCounts) -> None:
        """Add ``other``'s counts to these."""
        for name in GenerationCounts.model_fields:
            mine, theirs = getattr(self, name), getattr(other, name)
            if isinstance(mine, dict):
                for key, value in theirs.items():
                    mine[key] = mine.get(key, 0) + value
            else:
                setattr(self, name, mine + theirs)


class ShardSummary(GenerationCounts):
    """The small result of one generate_shard task (and the content of its done marker)."""

    schema_version: Literal[1] = RECORD_SCHEMA_VERSION
    dataset: str
    shard_index: int
    generation_s: float
    completions_path: str
    failures_path: str
    skipped: bool = Field(default=False, description="True when the shard was already complete in storage.")
    retry_round: int = Field(
        default=0, ge=0, description="The retry round this summary closes (0: the shard's first generation)."
    )
    retried_completions_paths: list[str] = Field(
        default_factory=list,
        description="Answers of the shard's retry rounds, beside completions_path (each request once in all); "
        "failures_path then holds every failure still standing.",
    )

    @property
    def all_completions_paths(self) -> list[str]:
        """Every file holding the shard's answers, first generation first."""
        return [self.completions_path, *self.retried_completions_paths]


def request_key(prompt_id: str, sample_index: int, turn: int | None = None) -> str:
    """The unique key of one request in a run; a conversation's turns (``multi_turn: on_policy``) add the turn."""
    if turn is None:
        return f"{prompt_id}/{sample_index}"
    return f"{prompt_id}/{sample_index}/{turn}"

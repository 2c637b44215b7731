"""Generate one prompt shard through the shared dispatcher, landing results write-once.

Storage is the truth, checked first and written last:

1. the shard's done marker exists -> the shard is complete; its summary is returned (``skipped``) and
   nothing is sent;
2. checkpoint parts (``parts/<dataset>/shard-NNNNN/{completions,failures}-NNNNN.jsonl``) left by an
   interrupted attempt hold finished requests; those are not sent again;
3. the remaining requests (each prompt x ``samples_per_prompt``) go to the dispatcher (in exact-token
   mode with their prompt rendered and tokenized here first, once per prompt); results are buffered and
   flushed as a new write-once part every ``checkpoint_every`` results or ``checkpoint_interval_s``
   seconds, whichever comes first. For on-policy conversations (``multi_turn: on_policy``) each turn is a
   request: each conversation's next turn after its last stored one is sent, and every turn that lands brings
   its conversation's next (:mod:`~datagen.generation.conversation`; in exact-token mode each turn is rendered
   as it is built, a later one from its history on the dispatcher's loop);
4. when every request has a result, the final completions and failures files are assembled from all
   parts (deduplicated by request key: the first occurrence wins and a completion beats a failure),
   each written once (or verified, when an interrupted attempt already wrote it), then the done marker.

Requests that ended unfinished (:func:`~datagen.generation.failures.fate`: the fleet was unavailable, the
dispatcher was closed, or admission stopped) are not results of the request: they are not checkpointed, and
the shard raises :class:`~datagen.errors.NoLiveServersError`, :class:`~datagen.errors.TransientRequestError`,
the storage fault that stopped admission, or :class:`~datagen.errors.WindowClosingError` when the generation
window stopped it (not transient: retrying the shard would only meet the closed admission) after checkpointing
everything else, so a rerun sends exactly those requests again instead of marking the shard done with them as
failures.

Parts are never deleted: they are write-once objects like everything else, small next to the final
files, and they are what makes an interrupted shard resumable. Cleaning them up is left to retention
policy on the bucket.

A storage fault costs nothing finished: a part flush that fails transiently keeps its results buffered and
is tried again at the next checkpoint (the shard goes on generating); the last flush is tried for up to
:data:`~datagen.generation.shard_parts.STORAGE_PATIENCE_S`. When the shard still ends with results unstored
(the task is then retried, or the run stops), they are left in :class:`HeldResults`, owned by the flow for
the whole run, and the next attempt of the shard in this process stores them first instead of generating
them again. A fault retrying cannot fix (no space, no permission, the bucket gone) raises
:class:`~datagen.errors.UnfixableStorageError` at once, and stops the dispatcher's admission for every shard
(:meth:`~datagen.generation.dispatcher.Dispatcher.stop_admission`): each answer after it would be lost, so the
work lost is bounded by what was in flight and unstored then.

``resent_requests`` in the summary counts the requests sent by this attempt when an earlier attempt of the
shard existed (it left a part, or held results in this process): the work redone after an interruption.
It is an upper bound of the requests that were actually in flight then, because the earlier attempt may
not have started all of them; it is 0 for a shard's first attempt.

This module owns the shard's run (steps 1 to 4 in order, the stream of requests, what is held after a fault);
the requests are built in :mod:`~datagen.generation.shard_requests`, the parts read and written in
:mod:`~datagen.generation.shard_parts`, the final files and done marker in
:mod:`~datagen.generation.shard_assembly`.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable

from datagen.config import RunConfig
from datagen.errors import (
    NoLiveServersError,
    TransientRequestError,
    UnfixableStorageError,
    WindowClosingError,
    is_transient,
)
from datagen.generation.conversation import ConversationChains
from datagen.generation.dispatch_state import GenerationResult
from datagen.generation.dispatcher import Dispatcher
from datagen.generation.failures import FailureKind, is_unfinished, retried_keys
from datagen.generation.openai_chat import GenerationRequest
from datagen.generation.sglang_generate import attach_prompt_tokens, prompt_encoder
from datagen.generation.shard_assembly import assemble, earlier_answers, latest_shard_summary
from datagen.generation.shard_parts import CheckpointWriter, read_parts
from datagen.generation.shard_requests import build_conversations, build_requests
from datagen.output.layout import RunLayout
from datagen.output.store import Store
from datagen.records import CompletionRecord, FailureRecord, PromptShardRef, ShardSummary

logger = logging.getLogger(__name__)

# ``progress(done, total, conversations_done)``: requests of the shard with a result and in all, and (on-policy)
# its conversations whose last turn has one (None for a shard of single requests).
ProgressCallback = Callable[[int, int, int | None], None]


class HeldResults:
    """Results of shard attempts that ended before storing them, kept for the shard's next attempt.

    The flow makes one per run and passes it to every shard attempt (a task retry included), so a storage
    fault never throws away finished answers. Thread-safe; in memory only (a crash loses what is here, as
    it loses what is in flight).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[tuple[str, int, int], tuple[list[CompletionRecord], list[FailureRecord]]] = {}
        self._attempted: set[tuple[str, int, int]] = set()

    def hold(
        self,
        dataset: str,
        index: int,
        completions: list[CompletionRecord],
        failures: list[FailureRecord],
        retry_round: int = 0,
    ) -> None:
        """Keep unstored results of one shard's round (added to any already held)."""
        with self._lock:
            kept = self._held.setdefault((dataset, index, retry_round), ([], []))
            kept[0].extend(completions)
            kept[1].extend(failures)

    def take(
        self, dataset: str, index: int, retry_round: int = 0
    ) -> tuple[list[CompletionRecord], list[FailureRecord], bool]:
        """The results held for one shard's round (removed from here), and whether an earlier attempt ran.

        Marks the round as attempted, so the next attempt knows its sends are resends.
        """
        key = (dataset, index, retry_round)
        with self._lock:
            completions, failures = self._held.pop(key, ([], []))
            earlier = key in self._attempted
            self._attempted.add(key)
        return completions, failures, earlier

    def count(self) -> int:
        """Results held for all shards (for logs and tests)."""
        with self._lock:
            return sum(len(c) + len(f) for c, f in self._held.values())


def generate_shard(
    store: Store,
    layout: RunLayout,
    config: RunConfig,
    shard: PromptShardRef,
    dispatcher: Dispatcher,
    *,
    progress: ProgressCallback | None = None,
    held: HeldResults | None = None,
    retry_failed: bool = False,
) -> ShardSummary:
    """Generate every completion of one prompt shard and land it in storage, resuming where it stopped.

    A shard already done is returned as it is, unless ``retry_failed``: then the failures its latest round
    left standing whose reason is not the prompt's own (:func:`~datagen.generation.failures.is_retryable`)
    are sent again as the next retry round, into objects of its own (see :mod:`datagen.output.layout`). An
    on-policy conversation resumes after its turns stored in earlier rounds: its failed turn is sent again, then
    the turns that failure ended (:func:`~datagen.generation.failures.retried_keys`).

    Args:
        store: The run's output store.
        layout: The run's object keys.
        config: The run configuration (sampling and checkpoint settings).
        shard: The prompt shard; ``shard.path`` is a key in ``store`` holding PromptRecord JSON lines.
        dispatcher: The running, shared dispatcher.
        progress: Called as ``progress(done, total, conversations_done)`` once the requests are handed to the
            dispatcher and after each result (``done`` includes requests finished by an earlier attempt;
            ``conversations_done``: on-policy conversations over, their last turn answered or ended; else None).
        held: Results earlier attempts of shards could not store (stored first here); this attempt leaves
            its own there when it ends without storing them.
        retry_failed: Send the retryable failures of a done shard again (a new retry round).

    Returns:
        The shard summary, also written as the shard's done marker.

    Raises:
        StorageError: A final file from an earlier attempt disagrees with the checkpoint parts, or the
            parts do not cover every request after generation.
        UnfixableStorageError: A write failed for a reason retrying cannot fix (no space, permission,
            no such bucket); the results not stored are held.
        NoLiveServersError: Some requests found no live server; the rest is checkpointed, rerun later.
        TransientRequestError: The dispatcher closed before every request finished; rerun the shard.

    """
    started = time.monotonic()
    dataset, index = shard.dataset, shard.shard_index
    on_policy = config.dataset(dataset).multi_turn == "on_policy"
    previous = latest_shard_summary(store, layout, dataset, index)
    standing: list[FailureRecord] = []
    retry_round = 0
    if previous is not None:
        if retry_failed and previous.failures:
            standing = [FailureRecord.model_validate(row) for row in store.iter_jsonl(previous.failures_path)]
        again = retried_keys(standing)
        if not again:
            logger.info(
                "shard already done dataset=%s shard=%d round=%d completions=%d failures=%d",
                dataset,
                index,
                previous.retry_round,
                previous.completions,
                previous.failures,
            )
            return previous.model_copy(update={"skipped": True})
        retry_round = previous.retry_round + 1
        logger.info(
            "retrying failures dataset=%s shard=%d round=%d requests=%d standing_failures=%d",
            dataset,
            index,
            retry_round,
            len(again),
            len(standing),
        )

    held = held if held is not None else HeldResults()
    kept_completions, kept_failures, attempted_before = held.take(dataset, index, retry_round)
    chains: ConversationChains | None = None
    shard_conversations: list[list[str]] | None = None
    answered: dict[str, CompletionRecord] = {}
    try:
        if on_policy:
            # Exact-token mode renders each turn as it is built: its history is known only then.
            prepare = (
                functools.partial(attach_prompt_tokens, encoder=prompt_encoder(config.model.tokenizer))
                if dispatcher.exact_tokens
                else None
            )
            chains = build_conversations(store, config, shard, prepare)
            shard_conversations = [c.turn_keys() for c in chains.conversations]
            keys = chains.keys()
            if previous is not None:
                # A retry round: the conversations it resumes, from their answers of earlier rounds.
                chains = chains.only(again)
                planned = chains.keys()
                keys = [key for key in planned if key in again]
                answered = earlier_answers(store, previous, set(planned) - again)
        else:
            requests = build_requests(store, config, shard)
            if previous is not None:
                requests = [request for request in requests if request.key in again]
            keys = [request.key for request in requests]
        earlier = read_parts(store, layout, dataset, index, retry_round=retry_round)
    except BaseException:
        held.hold(dataset, index, kept_completions, kept_failures, retry_round)
        raise
    finished = earlier.keys() | {r.key for r in kept_completions} | {r.key for r in kept_failures}
    # A conversations' stream delivers one result per turn left (``expected``); a plain one, one per request it
    # is given, after exact-token mode failed the unrenderable prompts without sending them (below).
    expected: int | None = None
    last_turns: set[str] = set()
    conversations_done: int | None = None
    if chains is None:
        to_send = [request for request in requests if request.key not in finished]
        left = len(to_send)
    else:
        # Each conversation goes on after its last stored turn (a completion beats a failure of the same turn);
        # a retry round's turns after the answers of earlier rounds.
        stored: dict[str, CompletionRecord | FailureRecord] = {
            **answered,
            **earlier.failures,
            **earlier.completions,
        }
        stored |= {record.key: record for record in kept_failures if record.key not in stored}
        stored |= {record.key: record for record in kept_completions}
        to_send, ended = chains.resume(stored)
        kept_failures.extend(ended)
        expected = left = sum(1 for key in keys if key not in stored) - len(ended)
        # A conversation is over once its last turn has a result; a retry round's others were over before it.
        over = stored.keys() | {record.key for record in kept_failures}
        last_turns = {conversation.turn_keys()[-1] for conversation in chains.conversations}
        conversations_done = len(shard_conversations or []) - len(last_turns) + len(last_turns & over)
    resent = len(to_send) if earlier.part_count or attempted_before else 0
    logger.info(
        "generate shard dataset=%s shard=%d requests=%d finished_earlier=%d to_send=%d resent=%d",
        dataset,
        index,
        len(keys),
        len(keys) - left,
        len(to_send),
        resent,
    )
    writer = CheckpointWriter(
        store, layout, dataset, index, earlier.next_completions_part, earlier.next_failures_part, retry_round
    )
    if kept_completions or kept_failures:
        logger.info(
            "storing results an earlier attempt could not dataset=%s shard=%d results=%d",
            dataset,
            index,
            len(kept_completions) + len(kept_failures),
        )
    if dispatcher.exact_tokens and chains is None:
        # Rendered here, in the shard task's thread, not on the dispatcher's loop; a prompt the template
        # cannot render fails without being sent (conversations' turns were rendered as they were built).
        to_send, unrenderable = attach_prompt_tokens(to_send, encoder=prompt_encoder(config.model.tokenizer))
        kept_failures.extend(unrenderable)
    try:
        writer.flush_patiently(kept_completions, kept_failures)
    except BaseException:
        held.hold(dataset, index, kept_completions, kept_failures, retry_round)
        raise
    _run_requests(
        dispatcher,
        to_send,
        writer,
        every=config.generation.checkpoint_every,
        interval_s=config.generation.checkpoint_interval_s,
        already_done=len(keys) - left,
        total=len(keys),
        progress=progress,
        held=held,
        expected=expected,
        chains=chains,
        conversations=(conversations_done, last_turns) if conversations_done is not None else None,
    )
    summary = assemble(
        store,
        layout,
        shard,
        keys,
        resent=resent,
        started=started,
        known=writer.written,
        previous=previous,
        standing=standing,
        conversations=shard_conversations,
    )
    logger.info(
        "shard done dataset=%s shard=%d round=%d completions=%d failures=%d completion_tokens=%d resent=%d "
        "generation_s=%.1f",
        dataset,
        index,
        retry_round,
        summary.completions,
        summary.failures,
        summary.completion_tokens,
        summary.resent_requests,
        summary.generation_s,
    )
    return summary


class ShardInbox:
    """Results handed from the dispatcher's loop to one shard's thread, in batches.

    The loop only appends; it wakes the shard's thread when a checkpoint's worth of results is waiting or
    the last one arrives. Waking a thread per result would make every thread in the process fight the
    loop for the GIL at the request rate; per batch it costs nothing.
    """

    def __init__(self, expected: int, batch: int) -> None:
        self._items: deque[tuple[float, GenerationResult]] = deque()
        self._event = threading.Event()
        self._expected = expected
        self._batch = batch
        self._broken: BaseException | None = None

    def fail(self, error: BaseException) -> None:
        """Called on the loop thread when results this inbox waits for will never come (a follow raised)."""
        self._broken = error
        self._event.set()

    def put(self, _request: GenerationRequest, result: GenerationResult) -> None:
        """Called on the dispatcher's loop thread for every result."""
        self._items.append((time.monotonic(), result))
        self._expected -= 1
        if len(self._items) >= self._batch or self._expected <= 0:
            self._event.set()

    def take(self, timeout: float | None) -> list[tuple[float, GenerationResult]]:
        """Wait up to ``timeout`` for a full batch (or the last result); return whatever has arrived."""
        self._event.wait(timeout)
        self._event.clear()
        items = []
        while self._items:
            items.append(self._items.popleft())
        return items

    def raise_if_broken(self) -> None:
        """Raise when results this inbox waits for will never come (:meth:`fail`).

        Raises:
            RuntimeError: Naming what broke; the shard stops and keeps what it took.
        """
        if self._broken is not None:
            raise RuntimeError(
                f"an on-policy conversation's next turn could not be built: {self._broken!r}"
            ) from self._broken


def _run_requests(
    dispatcher: Dispatcher,
    requests: list[GenerationRequest],
    writer: CheckpointWriter,
    *,
    every: int,
    interval_s: float,
    already_done: int,
    total: int,
    progress: ProgressCallback | None,
    held: HeldResults,
    expected: int | None = None,
    chains: ConversationChains | None = None,
    conversations: tuple[int, set[str]] | None = None,
) -> None:
    """Hand every request to the dispatcher as one stream, collect results in batches, checkpoint them.

    With ``chains`` (on-policy conversations), ``requests`` are each conversation's next turn and the stream
    follows them: each turn that lands brings its conversation's next one (or the failures of the turns it
    ended), ``expected`` results in all. ``conversations``: the shard's conversations over before this attempt
    and the last turns' keys of the others, so that progress counts each as its last turn's result lands.

    A checkpoint that fails transiently keeps its results and is tried again one interval later (the shard
    goes on collecting); results still unstored when this ends with an error are left in ``held``.
    """
    remaining = len(requests) if expected is None else expected
    inbox = ShardInbox(remaining, every)
    completions: list[CompletionRecord] = []
    failures: list[FailureRecord] = []
    oldest: float | None = None
    done = already_done
    conversations_done, last_turns = conversations if conversations is not None else (None, set())
    unserved: Counter[str] = Counter()
    follow = chains.follower(inbox.put, inbox.fail) if chains is not None else None
    stream = dispatcher.submit_stream(requests, inbox.put, follow=follow)
    if progress is not None:
        # Tells the flow's scheduler this shard's requests are now in the dispatcher's backlog.
        progress(done, total, conversations_done)
    try:
        while remaining:
            # Look at least twice per checkpoint interval, so no result waits much longer than that.
            timeout = interval_s / 2
            if oldest is not None:
                timeout = min(timeout, max(0.0, interval_s - (time.monotonic() - oldest)))
            arrived = inbox.take(timeout)
            for arrived_at, result in arrived:
                if oldest is None:
                    oldest = arrived_at
                if isinstance(result, CompletionRecord):
                    completions.append(result)
                elif is_unfinished(result):
                    unserved[result.error_type] += 1
                    continue  # handed back: its conversation goes on in the next attempt
                else:
                    failures.append(result)
                if conversations_done is not None and result.key in last_turns:
                    conversations_done += 1
            inbox.raise_if_broken()
            if arrived:
                remaining -= len(arrived)
                done += len(arrived)
                if progress is not None:
                    progress(done, total, conversations_done)
            buffered = len(completions) + len(failures)
            if not buffered:
                oldest = None
            elif buffered >= every or time.monotonic() - (oldest or 0.0) >= interval_s:
                try:
                    writer.flush(completions, failures)
                    oldest = None
                except Exception as error:
                    if not is_transient(error):
                        raise
                    # Kept in the buffers; the next try comes one interval later.
                    logger.warning(
                        "checkpoint failed, results kept dataset=%s shard=%d buffered=%d error=%s",
                        writer.dataset,
                        writer.index,
                        buffered,
                        error,
                    )
                    oldest = time.monotonic()
        writer.flush_patiently(completions, failures)
    except BaseException as error:
        if isinstance(error, UnfixableStorageError):
            # Every shard's answers from now on would be lost too: nothing more is sent, for any shard.
            dispatcher.stop_admission(error)
        # Free the fleet's slots for other shards: this shard's requests not yet in flight are dropped.
        stream.cancel()
        held.hold(writer.dataset, writer.index, completions, failures, writer.retry_round)
        raise
    _raise_if_unserved(unserved, writer, dispatcher.stopped_by)


def _raise_if_unserved(
    unserved: Counter[str], writer: CheckpointWriter, stopped_by: Exception | None
) -> None:
    if not unserved:
        return
    if unserved[FailureKind.ADMISSION_STOPPED] and isinstance(stopped_by, UnfixableStorageError):
        # The fault that stopped admission is this shard's too: the operator must act before any rerun.
        raise UnfixableStorageError(stopped_by.message, **stopped_by.context)
    count = sum(unserved.values())
    if isinstance(stopped_by, WindowClosingError):
        # The run's window ended this attempt: nothing failed, the run's next attempt sends these.
        raise WindowClosingError(
            f"shard {writer.dataset}/{writer.index}: the generation window closed with {count} requests "
            "unanswered; every other result is checkpointed",
            dataset=writer.dataset,
            shard=writer.index,
            unanswered=count,
        )
    # No live server is fatal until the fleet is back; a dispatcher that closed mid-shard is transient.
    error: type[NoLiveServersError | TransientRequestError] = TransientRequestError
    what, fix = f"the dispatcher closed before {count} requests finished", "Rerun the shard"
    if unserved[FailureKind.NO_LIVE_SERVERS]:
        error = NoLiveServersError
        what, fix = (
            f"{count} requests found no live server",
            "Bring the fleet back (check the server logs) and rerun",
        )
    raise error(
        f"shard {writer.dataset}/{writer.index}: {what}; every other result is checkpointed. "
        f"{fix}: only these requests are sent.",
        dataset=writer.dataset,
        shard=writer.index,
    )

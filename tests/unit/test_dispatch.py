"""The dispatcher against real HTTP servers that inject faults (tests/support/fault_server.py)."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, wait

import pytest

from datagen.config import GenerationConfig
from datagen.errors import UnfixableStorageError, WindowClosingError
from datagen.generation.dispatch_health import HEALTH_INTERVAL_S
from datagen.generation.dispatch_state import DispatcherStats, GenerationResult
from datagen.generation.dispatcher import Dispatcher
from datagen.generation.multihost import HostVouches
from datagen.generation.openai_chat import GenerationRequest
from datagen.records import CompletionRecord, FailureRecord, Message, PromptRecord, SamplingParams
from tests.support.fault_server import FaultPlan, FaultServer

FAST_RETRIES = GenerationConfig(
    backoff_initial_s=0.01,
    backoff_max_s=0.05,
    max_attempts=5,
    request_timeout_s=10,
    no_live_server_timeout_s=30,
)
# Generous: on a loaded 2-core CI box one re-dispatch after a server loss was once seen to take ~20 s.
RESULT_TIMEOUT_S = 60


def make_request(content: str, *, sample_index: int = 0, **sampling: object) -> GenerationRequest:
    prompt = PromptRecord(
        prompt_id=f"id-{content}", dataset="unit", messages=[Message(role="user", content=content)]
    )
    params = SamplingParams.model_validate({"max_tokens": 8, **sampling})
    return GenerationRequest(prompt=prompt, sample_index=sample_index, sampling=params, dataset="unit")


def results(futures: list[Future[GenerationResult]]) -> list[GenerationResult]:
    return [future.result(RESULT_TIMEOUT_S) for future in futures]


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def servers_up(dispatcher: Dispatcher) -> list[str]:
    stats: DispatcherStats = dispatcher.stats()
    return stats.servers_up


@pytest.fixture()
def server() -> Iterator[FaultServer]:
    with FaultServer() as fault_server:
        yield fault_server


def dispatcher_for(
    urls: list[str],
    *,
    cap: int = 4,
    generation: GenerationConfig = FAST_RETRIES,
    engine: str = "sglang",
    liveness: Callable[[str], bool] | None = None,
) -> Dispatcher:
    return Dispatcher(
        urls,
        model="test-model",
        engine=engine,
        max_inflight_per_server=cap,
        generation=generation,
        liveness=liveness,
    )


def test_transient_faults_are_retried_until_a_completion(server: FaultServer) -> None:
    with dispatcher_for([server.url]) as dispatcher:
        [record] = results([dispatcher.submit(make_request("[[500,empty,reset,429]] hello"))])

    assert isinstance(record, CompletionRecord)
    assert record.attempts == 5
    assert record.completion.content == "echo: [[500,empty,reset,429]] hello"
    assert [r.fault for r in server.chat_requests()] == ["500", "empty", "reset", "429", "ok"]
    assert dispatcher.stats().retries == 4


def test_a_chat_answer_the_server_aborted_is_retried_not_kept(server: FaultServer) -> None:
    with dispatcher_for([server.url]) as dispatcher:
        [record] = results([dispatcher.submit(make_request("[[abort]] hello"))])
    assert isinstance(record, CompletionRecord)
    assert record.finish_reason == "stop" and record.attempts == 2
    assert [r.fault for r in server.chat_requests()] == ["abort", "ok"]


def test_bad_request_is_a_failure_record_without_retry(server: FaultServer) -> None:
    with dispatcher_for([server.url]) as dispatcher:
        [record] = results([dispatcher.submit(make_request("[[400]] nope"))])

    assert isinstance(record, FailureRecord)
    assert record.error_type == "http_400"
    assert record.last_status == 400
    assert record.attempts == 1
    assert "400" in record.reason and "injected: bad request" in record.reason
    assert record.key == "id-[[400]] nope/0"
    assert len(server.chat_requests()) == 1


def test_exhausted_retries_record_the_last_error() -> None:
    generation = FAST_RETRIES.model_copy(update={"max_attempts": 3})
    with FaultServer() as server, dispatcher_for([server.url], generation=generation) as dispatcher:
        [record] = results([dispatcher.submit(make_request("[[500,500,500,500]] x"))])

    assert isinstance(record, FailureRecord)
    assert record.error_type == "retries_exhausted"
    assert record.attempts == 3
    assert record.last_status == 500
    assert "HTTP 500" in record.reason
    assert len(server.chat_requests()) == 3


def test_tool_call_arguments_are_parsed_and_unparseable_ones_are_failures(server: FaultServer) -> None:
    with dispatcher_for([server.url]) as dispatcher:
        good, bad = results(
            [dispatcher.submit(make_request("#toolcall #think")), dispatcher.submit(make_request("#badtool"))]
        )

    assert isinstance(good, CompletionRecord)
    assert good.finish_reason == "tool_calls"
    assert good.completion.tool_calls is not None
    assert good.completion.tool_calls[0].function.name == "get_weather"
    assert good.completion.tool_calls[0].function.arguments == {"city": "Paris"}
    assert good.completion.reasoning_content == "thinking about it"
    assert good.usage.prompt_tokens == 7 and good.usage.completion_tokens == 5
    assert good.server == server.url and good.model == "test-model" and good.engine == "sglang"
    assert isinstance(bad, FailureRecord)
    assert bad.error_type == "invalid_tool_arguments"
    assert "not valid JSON" in bad.reason


def test_request_body_carries_messages_sampling_and_thinking_switch(server: FaultServer) -> None:
    request = make_request(
        "body", temperature=0.3, top_p=0.9, top_k=20, min_p=0.05, seed=7, enable_thinking=False
    )
    with dispatcher_for([server.url]) as dispatcher:
        results([dispatcher.submit(request)])

    [seen] = server.chat_requests()
    assert seen.body == {
        "model": "test-model",
        "messages": [{"role": "user", "content": "body"}],
        "temperature": 0.3,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.05,
        "max_tokens": 8,
        "seed": 7,
        "stream": False,
        "chat_template_kwargs": {"enable_thinking": False},
    }


def test_transformers_engine_omits_the_sampling_fields_it_rejects(server: FaultServer) -> None:
    with dispatcher_for([server.url], engine="transformers") as dispatcher:
        results([dispatcher.submit(make_request("tf", top_k=20, min_p=0.05))])

    [seen] = server.chat_requests()
    assert seen.body is not None
    assert "top_k" not in seen.body and "min_p" not in seen.body
    assert seen.body["top_p"] == 0.95


def test_least_outstanding_routing_fills_every_server_up_to_its_cap() -> None:
    plan = FaultPlan(base_delay_s=0.05)
    with FaultServer(plan) as first, FaultServer(plan) as second:
        with dispatcher_for([first.url, second.url], cap=3) as dispatcher:
            wait_until(lambda: len(servers_up(dispatcher)) == 2)
            records = results([dispatcher.submit(make_request(f"r{i}")) for i in range(40)])

        assert all(isinstance(record, CompletionRecord) for record in records)
        assert first.max_in_flight == 3 and second.max_in_flight == 3
        assert len(first.chat_requests()) + len(second.chat_requests()) == 40
        assert abs(len(first.chat_requests()) - len(second.chat_requests())) <= 4


def test_every_future_resolves_under_random_faults_and_every_try_is_accounted() -> None:
    plan = FaultPlan(rates={"500": 0.15, "empty": 0.1, "reset": 0.1, "429": 0.05}, seed=3)
    # 500s here are random, not the request's fault: let them be retried as long as anything else.
    generation = FAST_RETRIES.model_copy(update={"max_attempts": 12, "max_internal_error_attempts": 12})
    with FaultServer(plan) as first, FaultServer(plan) as second:
        with dispatcher_for([first.url, second.url], cap=8, generation=generation) as dispatcher:
            futures = [dispatcher.submit(make_request(f"m{i}")) for i in range(200)]
            records = results(futures)
            stats = dispatcher.stats()
        tries = len(first.chat_requests()) + len(second.chat_requests())

    assert all(isinstance(record, CompletionRecord) for record in records)
    assert sorted(record.key for record in records) == sorted(f"id-m{i}/0" for i in range(200))
    assert sum(record.attempts for record in records) == tries
    assert stats.completed == 200 and stats.failed == 0 and stats.retries == tries - 200 > 0
    assert stats.queued == 0 and stats.backing_off == 0 and sum(stats.in_flight.values()) == 0


def test_two_shards_share_slots_without_a_barrier(server: FaultServer) -> None:
    # Shard A holds one slow request; shard B's requests must flow through the other slots meanwhile.
    submitted: dict[str, list[Future[GenerationResult]]] = {}
    with dispatcher_for([server.url], cap=3) as dispatcher:
        wait_until(lambda: len(servers_up(dispatcher)) == 1)

        def shard(name: str, contents: list[str]) -> None:
            submitted[name] = [dispatcher.submit(make_request(content)) for content in contents]

        slow = threading.Thread(target=shard, args=("a", ["#sleep=1.5 slow", "a1", "a2"]))
        slow.start()
        slow.join()
        fast = threading.Thread(target=shard, args=("b", [f"#sleep=0.05 b{i}" for i in range(12)]))
        fast.start()
        fast.join()
        wait(submitted["b"], timeout=RESULT_TIMEOUT_S)
        slow_future = submitted["a"][0]
        assert all(future.done() for future in submitted["b"])
        assert not slow_future.done(), "shard B waited for shard A's slow request"
        results(submitted["a"])
    assert server.max_in_flight == 3


def test_server_that_goes_away_loses_its_requests_to_the_others_and_rejoins_after_restart() -> None:
    plan = FaultPlan(base_delay_s=0.1)
    with FaultServer(plan) as steady:
        flaky = FaultServer(plan)
        flaky.start()
        with dispatcher_for([steady.url, flaky.url], cap=4) as dispatcher:
            wait_until(lambda: len(servers_up(dispatcher)) == 2)
            futures = [dispatcher.submit(make_request(f"g{i}")) for i in range(40)]
            wait_until(lambda: flaky.in_flight > 0)
            flaky.stop()
            records = results(futures)
            assert all(isinstance(record, CompletionRecord) for record in records)
            assert servers_up(dispatcher) == [steady.url]
            assert all(record.attempts <= 2 for record in records)

            flaky.start()  # same port: the health checker must bring it back
            wait_until(lambda: len(servers_up(dispatcher)) == 2)
            later = results([dispatcher.submit(make_request(f"later{i}")) for i in range(8)])
        flaky.stop()
    assert {record.server for record in later if isinstance(record, CompletionRecord)} == {
        steady.url,
        flaky.url,
    }


def test_with_a_vouch_a_gone_server_waits_for_its_hosts_word_whatever_answers_on_its_port() -> None:
    plan = FaultPlan(base_delay_s=0.05)
    vouches = HostVouches()
    with FaultServer(plan) as steady:
        remote = FaultServer(plan)
        remote.start()
        vouches.vouch([steady.url, remote.url], 0)
        with Dispatcher(
            [steady.url, remote.url],
            model="test-model",
            engine="sglang",
            max_inflight_per_server=2,
            generation=FAST_RETRIES,
            vouch=vouches.version,
        ) as dispatcher:
            wait_until(lambda: len(servers_up(dispatcher)) == 2)
            futures = [dispatcher.submit(make_request(f"v{i}")) for i in range(20)]
            wait_until(lambda: remote.in_flight > 0)
            remote.stop()
            assert all(isinstance(record, CompletionRecord) for record in results(futures))
            wait_until(lambda: servers_up(dispatcher) == [steady.url])
            # Something answers on its port again (for all the parent knows, another program): not trusted.
            remote.start()
            checks, chats = remote.health_checks, len(remote.chat_requests())
            more = [dispatcher.submit(make_request(f"w{i}")) for i in range(10)]
            time.sleep(3 * HEALTH_INTERVAL_S)
            assert remote.health_checks == checks and len(remote.chat_requests()) == chats
            assert servers_up(dispatcher) == [steady.url]
            # Its host says it restarted it there: probed, trusted, given requests.
            vouches.vouch([remote.url], 1)
            wait_until(lambda: len(servers_up(dispatcher)) == 2)
            later = results([dispatcher.submit(make_request(f"x{i}")) for i in range(8)])
            results(more)
        remote.stop()
    assert {record.server for record in later if isinstance(record, CompletionRecord)} == {
        steady.url,
        remote.url,
    }


def test_liveness_false_keeps_a_server_out_of_rotation(server: FaultServer) -> None:
    with FaultServer() as dead:
        with dispatcher_for([dead.url, server.url], liveness=lambda url: url != dead.url) as dispatcher:
            records = results([dispatcher.submit(make_request(f"l{i}")) for i in range(10)])
        assert dead.chat_requests() == []
    assert {record.server for record in records if isinstance(record, CompletionRecord)} == {server.url}


def test_requests_fail_with_no_live_servers_after_the_deadline() -> None:
    with FaultServer() as gone:
        url = gone.url
    generation = FAST_RETRIES.model_copy(update={"no_live_server_timeout_s": 0.5})
    started = time.monotonic()
    with dispatcher_for([url], generation=generation) as dispatcher:
        records = results([dispatcher.submit(make_request(f"n{i}")) for i in range(3)])

    assert all(
        isinstance(record, FailureRecord) and record.error_type == "no_live_servers" for record in records
    )
    assert time.monotonic() - started < 5


def test_close_resolves_requests_still_in_flight(
    server: FaultServer, caplog: pytest.LogCaptureFixture
) -> None:
    dispatcher = dispatcher_for([server.url], cap=1).start()
    done = dispatcher.submit(make_request("c-done"))
    assert isinstance(done.result(30), CompletionRecord)
    futures = [dispatcher.submit(make_request(f"#sleep=5 c{i}")) for i in range(3)]
    wait_until(lambda: server.in_flight == 1)
    with caplog.at_level(logging.INFO, logger="datagen.generation.dispatcher"):
        dispatcher.close()

    records = results(futures)
    assert all(
        isinstance(record, FailureRecord) and record.error_type == "dispatcher_closed" for record in records
    )
    # The close's own line keeps them apart from the run's failures: they are sent again, never recorded.
    assert "dispatcher closed completed=1 failed=0 unfinished=3 " in caplog.text


def test_a_dispatcher_leaves_the_interpreters_switch_interval_alone(server: FaultServer) -> None:
    before = sys.getswitchinterval()
    with dispatcher_for([server.url]) as dispatcher:
        assert isinstance(dispatcher.submit(make_request("gil")).result(30), CompletionRecord)
        assert sys.getswitchinterval() == before
    assert sys.getswitchinterval() == before


def test_submit_before_start_is_refused() -> None:
    dispatcher = dispatcher_for(["http://127.0.0.1:9"])
    with pytest.raises(RuntimeError, match="start"):
        dispatcher.submit(make_request("early"))


def test_a_request_every_server_answers_with_http_500_stops_early_without_using_all_attempts() -> None:
    generation = FAST_RETRIES.model_copy(update={"max_attempts": 6, "max_internal_error_attempts": 3})
    with FaultServer() as first, FaultServer() as second:
        with dispatcher_for([first.url, second.url], generation=generation) as dispatcher:
            wait_until(lambda: len(servers_up(dispatcher)) == 2)
            [record] = results([dispatcher.submit(make_request("[[500,500,500,500,500,500]] always broken"))])
            [healthy] = results([dispatcher.submit(make_request("[[500,ok]] broken once"))])
        tries = len(first.chat_requests()) + len(second.chat_requests())

    assert isinstance(record, FailureRecord)
    assert record.error_type == "repeated_internal_error"
    assert record.attempts == 3, "three 500s from two servers are enough: a retry redoes a whole generation"
    # The fault server counts attempts per server: the second request gets one 500 from each, then an answer.
    assert isinstance(healthy, CompletionRecord) and healthy.attempts == 3
    assert tries == 3 + 3


def test_streams_are_admitted_oldest_first_and_never_beyond_the_admission_limit(server: FaultServer) -> None:
    delivered: list[str] = []
    lock = threading.Lock()
    done = threading.Event()

    def deliver(request: GenerationRequest, result: GenerationResult) -> None:
        with lock:
            delivered.append(request.prompt.messages[0].content or "")
            if len(delivered) == 12:
                done.set()

    dispatcher = Dispatcher(
        [server.url],
        model="test-model",
        engine="sglang",
        max_inflight_per_server=2,
        generation=FAST_RETRIES,
        admission_limit=3,
    )
    with dispatcher:
        wait_until(lambda: len(servers_up(dispatcher)) == 1)
        first = dispatcher.submit_stream([make_request(f"#sleep=0.02 a{i}") for i in range(6)], deliver)
        second = dispatcher.submit_stream([make_request(f"#sleep=0.02 b{i}") for i in range(6)], deliver)
        assert done.wait(RESULT_TIMEOUT_S)
        stats = dispatcher.stats()

    arrivals = [(seen.body or {})["messages"][0]["content"].split()[-1] for seen in server.chat_requests()]
    assert arrivals[:6] == [f"a{i}" for i in range(6)], "the older stream's requests go first"
    assert sorted(arrivals[6:]) == [f"b{i}" for i in range(6)]
    assert server.max_in_flight == 2
    assert first.pending == second.pending == 0
    assert stats.backlog == 0 and stats.completed == 12


def test_a_cancelled_stream_sends_none_of_its_waiting_requests(server: FaultServer) -> None:
    dispatcher = Dispatcher(
        [server.url],
        model="test-model",
        engine="sglang",
        max_inflight_per_server=1,
        generation=FAST_RETRIES,
        admission_limit=1,
    )
    results_seen: list[GenerationResult] = []
    with dispatcher:
        wait_until(lambda: len(servers_up(dispatcher)) == 1)
        stream = dispatcher.submit_stream(
            [make_request(f"#sleep=0.3 c{i}") for i in range(5)],
            lambda _r, result: results_seen.append(result),
        )
        wait_until(lambda: server.in_flight == 1)
        stream.cancel()
        [after] = results([dispatcher.submit(make_request("after"))])

    assert isinstance(after, CompletionRecord)
    # The one in flight at the cancel finishes on the server; its result is dropped with the stream.
    assert [seen.body["messages"][0]["content"] for seen in server.chat_requests() if seen.body] == [
        "#sleep=0.3 c0",
        "after",
    ]
    assert results_seen == []


def test_stopped_admission_sends_nothing_more_and_ends_every_waiting_request_unfinished(
    server: FaultServer, caplog: pytest.LogCaptureFixture
) -> None:
    fault = UnfixableStorageError("storage write failed and retrying cannot fix it: ENOSPC", cause="ENOSPC")
    with dispatcher_for([server.url], cap=2) as dispatcher:
        wait_until(lambda: len(servers_up(dispatcher)) == 1)
        first = [dispatcher.submit(make_request(f"#sleep=0.5 s{i}")) for i in range(8)]
        wait_until(lambda: server.in_flight == 2)
        dispatcher.stop_admission(fault)
        ended = results(first)
        [later] = results([dispatcher.submit(make_request("later"))])
        stats = dispatcher.stats()
        with caplog.at_level(logging.INFO, logger="datagen.generation.dispatcher"):
            dispatcher.close()

    assert dispatcher.stopped_by is fault
    # The two in flight at the stop are answered; nothing else reaches the server, then or later.
    assert [type(result) for result in ended[:2]] == [CompletionRecord, CompletionRecord]
    unsent = [*ended[2:], later]
    assert all(isinstance(r, FailureRecord) and r.error_type == "admission_stopped" for r in unsent), unsent
    assert all("ENOSPC" in r.reason for r in unsent if isinstance(r, FailureRecord))
    assert len(server.chat_requests()) == 2
    # Unfinished requests are not the run's failures: the progress line and the close line keep them apart.
    assert (stats.completed, stats.failed, stats.unfinished) == (2, 0, 7)
    assert "dispatcher closed completed=2 failed=0 unfinished=7 " in caplog.text


def test_a_stream_registered_after_admission_stopped_and_the_loop_closed_ends_unsent_not_with_an_error(
    server: FaultServer,
) -> None:
    # A window's end stops admission, then cuts (closes) the dispatcher; a shard task still starting registers
    # its requests only afterwards.
    window = WindowClosingError("the generation window is closing")
    with dispatcher_for([server.url], cap=2) as dispatcher:
        wait_until(lambda: len(servers_up(dispatcher)) == 1)
        dispatcher.stop_admission(window)
    delivered: list[GenerationResult] = []
    dispatcher.submit_stream(
        [make_request(f"late {index}") for index in range(3)],
        lambda _request, result: delivered.append(result),
    )
    assert len(delivered) == 3 and not server.chat_requests()
    assert all(isinstance(r, FailureRecord) and r.error_type == "admission_stopped" for r in delivered), (
        delivered
    )
    assert all(
        "the generation window is closing" in r.reason for r in delivered if isinstance(r, FailureRecord)
    )
    # Closed without a stop, a dispatcher still refuses: submitting to it is the caller's mistake.
    with dispatcher_for([server.url], cap=2) as unstopped:
        pass
    with pytest.raises(RuntimeError, match="call start"):
        unstopped.submit(make_request("too late"))


def test_a_server_added_with_its_own_cap_is_kept_at_that_cap_beside_the_others() -> None:
    # Multi-host: each box plans its own in-flight cap (its GPUs); the dispatcher keeps each server at its own.
    plan = FaultPlan(base_delay_s=0.2)
    with FaultServer(plan) as small, FaultServer(plan) as large:
        with dispatcher_for([small.url], cap=2) as dispatcher:
            dispatcher.add_server(large.url, max_inflight=6)
            wait_until(lambda: len(servers_up(dispatcher)) == 2)
            records = results([dispatcher.submit(make_request(f"q{index}")) for index in range(48)])
        assert all(isinstance(record, CompletionRecord) for record in records)
        assert small.max_in_flight == 2 and large.max_in_flight == 6
        # Shares follow the caps: the large server answered about three times as many.
        assert len(large.chat_requests()) > 2 * len(small.chat_requests())


def test_a_server_hung_on_chat_with_a_healthy_health_is_marked_down_and_its_requests_resent() -> None:
    # The default request timeout (1,800 s) stays: only the stall rule may rescue the hung server's requests.
    generation = FAST_RETRIES.model_copy(update={"request_timeout_s": 1800.0, "stall_min_s": 1.0})
    plan = FaultPlan(base_delay_s=0.02)
    with FaultServer(plan) as steady, FaultServer(plan) as hung:
        hung.answering.clear()  # chat requests wait forever; /health still answers 200
        with dispatcher_for([steady.url, hung.url], cap=4, generation=generation) as dispatcher:
            wait_until(lambda: len(servers_up(dispatcher)) == 2)
            started = time.monotonic()
            futures = [dispatcher.submit(make_request(f"h{i}")) for i in range(40)]
            wait_until(lambda: hung.in_flight > 0)
            records = results(futures)
            elapsed_s = time.monotonic() - started
        hung.answering.set()
        wait_until(lambda: hung.in_flight == 0)  # its handlers see the closed connections and end

    assert all(isinstance(record, CompletionRecord) for record in records)
    assert {record.server for record in records if isinstance(record, CompletionRecord)} == {steady.url}
    assert hung.chat_requests(), "the hung server was given requests before it was found out"
    assert elapsed_s < 30, f"the hung server's requests waited {elapsed_s:.0f}s"


def test_connection_resets_count_toward_the_repeated_error_limit() -> None:
    generation = FAST_RETRIES.model_copy(update={"max_attempts": 6, "max_internal_error_attempts": 3})
    with (
        FaultServer() as first,
        FaultServer() as second,
        dispatcher_for([first.url, second.url], generation=generation) as dispatcher,
    ):
        wait_until(lambda: len(servers_up(dispatcher)) == 2)
        [record] = results([dispatcher.submit(make_request("[[reset,reset,reset,reset]] crashes servers"))])

    assert isinstance(record, FailureRecord)
    assert record.error_type == "repeated_internal_error"
    assert record.attempts == 3, "three resets on two servers are enough: each one takes a server's work down"


def test_a_moved_server_is_used_at_its_new_url_only() -> None:
    with FaultServer() as before, FaultServer() as after:
        with dispatcher_for([before.url], cap=3) as dispatcher:
            wait_until(lambda: servers_up(dispatcher) == [before.url])
            dispatcher.move_server(before.url, after.url)
            wait_until(lambda: servers_up(dispatcher) == [after.url])
            records = results([dispatcher.submit(make_request(f"m{i}")) for i in range(6)])
            caps = [server.url for server in dispatcher.stats().servers]
        assert before.chat_requests() == []
    assert caps == [after.url]
    assert all(isinstance(record, CompletionRecord) and record.server == after.url for record in records)
    assert after.max_in_flight <= 3

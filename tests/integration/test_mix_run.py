"""A run mixing all ten dataset layouts matches its configured mix; per-dataset sampling reaches the wire.

The dataset files are generated here, bigger than the bundled samples, in each layout's real file type
(Parquet, JSON Lines, one JSON array), with bad rows and prompts repeated across datasets. Prompts are
prepared the way the flow prepares them: in config order, each dataset deduplicated against the ones
before it and handed their summaries. No model server is needed for the mix; the sampling test uses a
small OpenAI-compatible server from tests/support.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import uuid
from collections import Counter
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from datagen.config import RunConfig, parse_run_config
from datagen.generation.dispatcher import Dispatcher
from datagen.generation.shard import generate_shard
from datagen.output.layout import RunLayout
from datagen.output.s3_client import S3Credentials, make_s3_client
from datagen.output.store import Store
from datagen.prompts.mix import mix_table, plan_mix
from datagen.prompts.parallel import DatasetScans, local_bytes
from datagen.prompts.prepare import (
    iter_prompt_shard,
    load_prompt_ids,
    prepare_prompts,
    scan_request,
    start_dataset_scans,
)
from datagen.records import CompletionRecord, PreparedDataset
from tests.support.children import ChildWatch
from tests.support.fault_server import FaultServer

GENERATOR = Path(__file__).resolve().parents[1] / "fixtures" / "datasets" / "build_samples.py"
ROWS = 100
AGENTINSTRUCT_ROWS = 12  # fewer valid rows than its quota: a shortfall the report must show
TOTAL_PROMPTS = 400
CODE_CAP = 0.2


def load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("build_samples", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SAMPLES = load_generator()


def chat_question(i: int) -> str:
    return f"Suggest a name for a bakery on street number {i}."


def rows_for(format: str, count: int) -> list[dict[str, Any]]:
    """``count`` distinct, valid rows of ``format`` plus hostile ones (rows we know the outcome of)."""
    rows: list[dict[str, Any]] = []
    for i in range(count):
        if format == "infinity_instruct":
            rows.append(
                {
                    "id": f"ii{i}",
                    "conversations": [
                        {"from": "human", "value": chat_question(i)},
                        {"from": "gpt", "value": "Crumb & Co."},
                    ],
                    "label": {
                        "ability_en": ["naming"],
                        "ability_zh": [],
                        "cate_ability_en": [],
                        "cate_ability_zh": [],
                    },
                    "langdetect": "en",
                    "source": "gen",
                    "reward": 1.0,
                }
            )
        elif format == "webinstruct":
            rows.append(
                {
                    "question": f"Why is the sky blue at altitude {i} m?",
                    "answer": "Rayleigh.",
                    "source": "socratic",
                }
            )
        elif format == "codefeedback_filtered":
            rows.append(
                {
                    "query": f"Write a Python function returning {i} squared.",
                    "answer": "def f(): ...",
                    "lang": "python",
                }
            )
        elif format == "code_feedback":
            rows.append(
                {
                    "id": i,
                    "messages": [
                        {"role": "user", "content": f"Write a loop printing 1..{i} in C."},
                        {"role": "assistant", "content": "for (...) {...}"},
                        {"role": "user", "content": "Execution result:\n1 2 3\nNow make it count down."},
                        {"role": "assistant", "content": "for (... --) {...}"},
                    ],
                }
            )
        elif format == "metamath":
            q = f"Tom has {i} apples and buys 2 more. How many?"
            rows.append(
                {
                    "query": q,
                    "response": f"The answer is: {i + 2}",
                    "type": "GSM_AnsAug",
                    "original_question": q,
                }
            )
        elif format == "hermes_fc":
            rows.append(
                {
                    "id": f"h{i}",
                    "conversations": [
                        {
                            "from": "system",
                            "value": SAMPLES.HERMES_SYSTEM.format(tools=SAMPLES.FLIGHT_TOOLS_REPR),
                        },
                        {"from": "human", "value": f"Find a flight from BOS to DEN on day {i} of March."},
                        {
                            "from": "gpt",
                            "value": '<tool_call>\n{"name": "search_flights", "arguments": {"origin": "BOS"}}\n</tool_call>',
                        },
                    ],
                    "category": "Travel",
                    "subcategory": "Flights",
                    "task": "Search flights",
                }
            )
        elif format == "agentinstruct":
            rows.append(
                {
                    "id": f"os_{i}",
                    "conversations": [
                        {
                            "from": "human",
                            "loss": False,
                            "value": f"Count files in /tmp/dir{i}. Act: bash or answer.",
                        },
                        {"from": "gpt", "loss": True, "value": "Act: bash\n```bash\nls | wc -l\n```"},
                    ],
                }
            )
        elif format == "toucan":
            question = f"What's the weather in city number {i}?"
            rows.append(
                {
                    "uuid": f"tc{i}",
                    "subset_name": "single-turn-original",
                    "question": question,
                    "messages": json.dumps(
                        [{"role": "user", "content": question}, {"role": "assistant", "content": "Sunny."}]
                    ),
                    "metadata": json.dumps({"mcp_servers": []}),
                }
            )
        elif format == "sharegpt":
            # Every fourth row asks what infinity_instruct already asked: a cross-dataset duplicate.
            text = chat_question(i) if i % 4 == 0 else f"Tell me a fact about the number {i}."
            rows.append(
                {
                    "id": f"sg{i}",
                    "conversations": [{"from": "human", "value": text}, {"from": "gpt", "value": "ok"}],
                }
            )
        else:
            rows.append(
                {
                    "id": f"om{i}",
                    "messages": [
                        {"role": "user", "content": f"Proofread sentence {i}: their going home."},
                        {"role": "assistant", "content": "They're going home."},
                    ],
                }
            )
    # Hostile rows every layout must count, not crash on: a row of the wrong shape, and a repeat.
    rows.append({"unexpected": "shape"})
    rows.append(rows[0])
    return rows


# (name, format, category, share, rows); the shares add up to 1, the code share (25%) exceeds its cap.
DATASETS: list[tuple[str, str, str, float, int]] = [
    ("infinity-instruct", "infinity_instruct", "chat", 0.15, ROWS),
    ("webinstruct", "webinstruct", "science", 0.10, ROWS),
    ("codefeedback", "codefeedback_filtered", "code", 0.15, ROWS),
    ("code-feedback", "code_feedback", "code", 0.10, ROWS),
    ("metamath", "metamath", "math", 0.20, ROWS),
    ("hermes-fc", "hermes_fc", "tools", 0.10, ROWS),
    ("agentinstruct", "agentinstruct", "agent", 0.05, AGENTINSTRUCT_ROWS),
    ("toucan", "toucan", "agent", 0.05, ROWS),
    ("sharegpt", "sharegpt", "chat", 0.05, ROWS),
    ("openai-messages", "openai_messages", "chat", 0.05, ROWS),
]


@pytest.fixture(scope="module")
def dataset_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    directory = tmp_path_factory.mktemp("mix-datasets")
    files = {}
    for name, format, _, _, count in DATASETS:
        kind = SAMPLES.SAMPLES[format][0]
        path = directory / f"{name}.{kind}"
        SAMPLES.write_rows(path, kind, rows_for(format, count))
        files[name] = str(path)
    return files


def mix_config(files: dict[str, str], *, rebalance: bool) -> RunConfig:
    datasets = [
        {
            "name": name,
            "format": format,
            "path": files[name],
            "category": category,
            "share": share,
            "shard_size": 32,
        }
        for name, format, category, share, _ in DATASETS
    ]
    datasets[3]["multi_turn"] = "every_turn"
    return parse_run_config(
        {
            "run_id": "mix",
            "model": {"path": "unused"},
            "datasets": datasets,
            "output": "unused",
            "seed": 7,
            "mix": {
                "total_prompts": TOTAL_PROMPTS,
                "category_caps": {"code": CODE_CAP},
                "rebalance": rebalance,
            },
            "existing_corpus": {"category_counts": {"code": 694_540, "math": 120_000, "chat": 87_460}},
        }
    )


def prepare_all(
    store: Store, layout: RunLayout, config: RunConfig, scans: DatasetScans | None = None
) -> list[PreparedDataset]:
    """What the flow does: config order, dedupe against the earlier datasets, pass their summaries."""
    prepared: list[PreparedDataset] = []
    for dataset in config.datasets:
        taken: set[str] = set()
        for earlier in prepared:
            taken |= load_prompt_ids(store, earlier)
        prepared.append(
            prepare_prompts(
                store, layout, config, dataset.name, exclude_prompt_ids=taken, earlier=prepared, scans=scans
            )
        )
    return prepared


def stored_files(root: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(root)): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()
    }


@pytest.mark.parametrize(("split", "rebalance"), [("per dataset", False), ("in blocks", True)])
def test_datasets_scanned_in_parallel_prepare_byte_for_byte_what_one_after_another_does(
    tmp_path: Path,
    dataset_files: dict[str, str],
    rebalance: bool,
    split: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # All ten layouts, category caps, every_turn, malformed rows, repeats within a dataset and across
    # datasets (the first dataset in config order keeps a prompt), shortfalls moved on under rebalance.
    config = mix_config(dataset_files, rebalance=rebalance)
    layout = RunLayout("mix")
    sequential = prepare_all(Store(str(tmp_path / "sequential")), layout, config)
    parallel_store = Store(str(tmp_path / "parallel"))
    with ChildWatch() as watch:
        if split == "per dataset":
            # Files of exactly the threshold's bytes are worth workers (one byte fewer: see the next test).
            total = sum(local_bytes(path) for path in dataset_files.values())
            scans = start_dataset_scans(
                parallel_store, layout, config, tmp_path / "scans", max_workers=3, min_worker_bytes=total
            )
            parts = 1
        else:
            # Every dataset dealt out over three workers in blocks of 7 rows (the last part gets fewer blocks).
            parts = 3
            requests = [replace(scan_request(config, d), block_rows=7) for d in config.datasets]
            scans = DatasetScans(
                requests, tmp_path / "scans", workers=3, parts=dict.fromkeys(dataset_files, parts)
            )
        with caplog.at_level(logging.INFO, logger="datagen.prompts.parallel"), scans:
            parallel = prepare_all(parallel_store, layout, config, scans)
    assert parallel == sequential
    assert len(watch.commands("-m datagen.prompts.scan")) == len(config.datasets) * parts
    assert sum(item.rejections.get("duplicate", 0) for item in sequential) > 0
    assert stored_files(tmp_path / "parallel") == stored_files(tmp_path / "sequential")
    # The workers did the scanning (none fell back to this process), and left no spool behind.
    scanned = [record.getMessage() for record in caplog.records if "scanned dataset=" in record.getMessage()]
    assert len(scanned) == len(config.datasets) * parts
    assert not [
        r for r in caplog.records if r.name == "datagen.prompts.parallel" and r.levelno >= logging.WARNING
    ]
    assert list((tmp_path / "scans").iterdir()) == []


def test_small_datasets_are_scanned_in_the_preparing_process_with_no_worker_started(
    tmp_path: Path, dataset_files: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    config = mix_config(dataset_files, rebalance=True)
    layout = RunLayout("mix")
    sequential = prepare_all(Store(str(tmp_path / "sequential")), layout, config)
    total = sum(local_bytes(path) for path in dataset_files.values())
    with caplog.at_level(logging.INFO, logger="datagen.prompts"), ChildWatch() as watch:
        # One byte short of the threshold, then the default one (16 MiB, far above these files).
        for name, threshold in (("short", {"min_worker_bytes": total + 1}), ("default", {})):
            store = Store(str(tmp_path / name))
            with start_dataset_scans(store, layout, config, tmp_path / "scans", **threshold) as scans:
                assert prepare_all(store, layout, config, scans) == sequential
            assert stored_files(tmp_path / name) == stored_files(tmp_path / "sequential")
    assert watch.started == {}
    messages = [record.getMessage() for record in caplog.records]
    assert sum("scanning datasets in this process: 10 datasets," in message for message in messages) == 2
    assert any(message.endswith(" KiB of files (< 16 MiB)") for message in messages)
    assert not [message for message in messages if "scanned dataset=" in message]


def test_s3_datasets_are_scanned_in_workers_however_small(
    tmp_path: Path, dataset_files: dict[str, str], s3_endpoint: str
) -> None:
    # Their size is not known before reading, and their reads wait on the network: workers overlap them.
    credentials = S3Credentials(
        access_key_id="testing", secret_access_key="testing", region="us-east-1", endpoint_url=s3_endpoint
    )
    client = make_s3_client(credentials=credentials)
    bucket = f"mix-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    datasets = []
    for name, format in (("sharegpt", "sharegpt"), ("openai-messages", "openai_messages")):
        local = Path(dataset_files[name])
        client.put_object(Bucket=bucket, Key=local.name, Body=local.read_bytes())
        datasets.append({"name": name, "format": format, "path": f"s3://{bucket}/{local.name}"})
    config = parse_run_config(
        {"run_id": "mix", "model": {"path": "unused"}, "datasets": datasets, "output": "unused", "seed": 7}
    )
    layout = RunLayout("mix")
    sequential = prepare_all(Store(str(tmp_path / "sequential"), credentials=credentials), layout, config)
    store = Store(str(tmp_path / "s3"), credentials=credentials)
    with ChildWatch() as watch, start_dataset_scans(store, layout, config, tmp_path / "scans") as scans:
        assert prepare_all(store, layout, config, scans) == sequential
    assert len(watch.commands("-m datagen.prompts.scan")) == 2


def test_a_run_mixing_all_ten_layouts_matches_its_configured_mix(
    store_root: Path, dataset_files: dict[str, str]
) -> None:
    store = Store(str(store_root))
    config = mix_config(dataset_files, rebalance=False)
    prepared = {item.dataset: item for item in prepare_all(store, RunLayout("mix"), config)}

    counts = {name: item.prompts for name, item in prepared.items()}
    # Code is capped at 20% of the new prompts: the other 300 make up 80%, so 375 in all and code 75,
    # split 60:40 between its two datasets; every other dataset gets its share of 400.
    expected = {name: round(share * TOTAL_PROMPTS) for name, _, _, share, _ in DATASETS}
    expected |= {"codefeedback": 45, "code-feedback": 30, "agentinstruct": AGENTINSTRUCT_ROWS}
    assert counts == expected
    assert {name: plan for name in counts if (plan := plan_mix(config).quota(name)) != counts[name]} == {
        "agentinstruct": 20
    }

    by_category: Counter[str] = Counter()
    for name, _, category, _, _ in DATASETS:
        by_category[category] += counts[name]
    total = sum(by_category.values())
    planned_total = total + (20 - AGENTINSTRUCT_ROWS)
    # The cap holds for the plan; agent's shortfall (reported, not rebalanced) leaves code above 20%
    # of what was actually prepared.
    assert by_category["code"] / planned_total <= CODE_CAP
    table = {row.category: row for row in mix_table(config, list(prepared.values()), {})}
    for category, row in table.items():
        if category in by_category:
            assert row.prompts == by_category[category]
            assert row.target_share is not None
            assert abs(row.prompts + row.shortfall - row.target_share * planned_total) <= 1
    assert table["agent"].shortfall == 20 - AGENTINSTRUCT_ROWS
    assert table["code"].target_share == pytest.approx(CODE_CAP)

    # Every rejection is counted: the bad row, the repeated row, cross-dataset repeats, the unsampled.
    assert all(item.rejections["malformed"] == 1 for item in prepared.values())
    taken_by_infinity = {
        record.messages[-1].content
        for shard in prepared["infinity-instruct"].shards
        for record in iter_prompt_shard(store, shard)
    }
    repeats = sum(chat_question(i) in taken_by_infinity for i in range(0, ROWS, 4))
    assert 0 < repeats < ROWS // 4  # only what infinity-instruct's sample took is taken
    assert prepared["sharegpt"].rejections["duplicate"] == 1 + repeats
    for name, item in prepared.items():
        per_row = 2 if name == "code-feedback" else 1
        assert (
            item.prompts + sum(item.rejections.values()) == (item.rows_read - 1) * per_row + 1
        )  # the malformed row

    # The every_turn dataset asks for both assistant turns of its conversations.
    turns = Counter(
        record.metadata["turn_index"]
        for shard in prepared["code-feedback"].shards
        for record in iter_prompt_shard(store, shard)
    )
    assert set(turns) == {0, 1}


def test_rebalance_moves_a_shortfall_to_the_next_dataset_of_its_category(
    store_root: Path, dataset_files: dict[str, str]
) -> None:
    store = Store(str(store_root))
    config = mix_config(dataset_files, rebalance=True)
    prepared = {item.dataset: item for item in prepare_all(store, RunLayout("mix-rebalanced"), config)}
    assert prepared["agentinstruct"].prompts == AGENTINSTRUCT_ROWS
    assert prepared["toucan"].prompts == 20 + (20 - AGENTINSTRUCT_ROWS)
    table = {row.category: row for row in mix_table(config, list(prepared.values()), {})}
    assert (table["agent"].prompts, table["agent"].shortfall) == (40, 0)
    # Rebalanced, the prepared prompts match the plan: code at its cap of the new prompts, exactly.
    assert sum(item.prompts for item in prepared.values()) == 375
    assert table["code"].prompt_share == pytest.approx(CODE_CAP)


def test_each_datasets_sampling_overrides_reach_the_server(store_root: Path, tmp_path: Path) -> None:
    store = Store(str(store_root))
    layout = RunLayout("sampling")
    metamath = tmp_path / "metamath.json"
    SAMPLES.write_rows(metamath, "json", rows_for("metamath", 3))
    web = tmp_path / "web.jsonl"
    SAMPLES.write_rows(web, "jsonl", rows_for("webinstruct", 3))
    config = parse_run_config(
        {
            "run_id": "sampling",
            "model": {"path": "unused"},
            "sampling": {"temperature": 0.6, "top_p": 0.9, "max_tokens": 64},
            "datasets": [
                {
                    "name": "math",
                    "format": "metamath",
                    "path": str(metamath),
                    "sampling": {
                        "temperature": 0.1,
                        "top_p": 0.5,
                        "max_tokens": 7,
                        "enable_thinking": False,
                        "samples_per_prompt": 2,
                    },
                },
                {"name": "web", "format": "webinstruct", "path": str(web)},
            ],
            "output": str(store_root),
            "generation": {"backoff_initial_s": 0.01, "request_timeout_s": 30},
        }
    )
    shards = [
        shard
        for dataset in ("math", "web")
        for shard in prepare_prompts(store, layout, config, dataset).shards
    ]
    with FaultServer() as server:
        with Dispatcher(
            [server.url],
            model="m",
            engine="external",
            max_inflight_per_server=4,
            generation=config.generation,
        ) as dispatcher:
            summaries = [generate_shard(store, layout, config, shard, dispatcher) for shard in shards]
        bodies = [request.body for request in server.chat_requests() if request.body is not None]

    assert [summary.completions for summary in summaries] == [6, 3]
    math = [body for body in bodies if "apples" in body["messages"][-1]["content"]]
    web_bodies = [body for body in bodies if "sky" in body["messages"][-1]["content"]]
    assert len(math) == 6 and len(web_bodies) == 3
    assert Counter(body["messages"][-1]["content"] for body in math).most_common()[-1][1] == 2
    for body in math:
        assert (body["temperature"], body["top_p"], body["max_tokens"]) == (0.1, 0.5, 7)
        assert body["chat_template_kwargs"] == {"enable_thinking": False}
    for body in web_bodies:
        assert (body["temperature"], body["top_p"], body["max_tokens"]) == (0.6, 0.9, 64)
        assert "chat_template_kwargs" not in body
    records = [
        CompletionRecord.model_validate(row) for row in store.iter_jsonl(layout.completions("math", 0))
    ]
    assert {(r.sampling.max_tokens, r.sampling.enable_thinking) for r in records} == {(7, False)}
    assert sorted(r.sample_index for r in records) == [0, 0, 0, 1, 1, 1]

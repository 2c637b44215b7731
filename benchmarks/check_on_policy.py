"""Check a finished run's on-policy conversations from its stored records: each history is the target's own.

For every on-policy conversation (records with a ``turn``) of a run on a local output root, whatever engine
made it (the CPU demo, a GPU box): its stored turns are 0, 1, ... without a gap, each key is stored once, and
each later turn's request holds, as its assistant turns, exactly the answers stored for the turns before it
(content, reasoning and tool calls), in order; the dataset's own answers never appear. Prints one line per
dataset and exits 1 on the first conversation that breaks a rule.

    make demo DEMO_RUN_ID=demo-1 && python benchmarks/check_on_policy.py runs/demo-1
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from datagen.records import CompletionRecord, Message  # noqa: E402


def _answer(record: CompletionRecord) -> tuple[object, ...]:
    completion = record.completion
    calls = [(call.function.name, call.function.arguments) for call in completion.tool_calls or []]
    return completion.content, completion.reasoning_content, calls


def _history_answer(message: Message) -> tuple[object, ...]:
    calls = [(call.function.name, call.function.arguments) for call in message.tool_calls or []]
    return message.content, message.reasoning_content, calls


def check(run_dir: Path) -> dict[str, tuple[int, int]]:
    """Conversations and turns per on-policy dataset of the run; raises AssertionError naming a broken one."""
    conversations: dict[tuple[str, str, int], dict[int, CompletionRecord]] = defaultdict(dict)
    for path in sorted((run_dir / "completions").glob("*/*.jsonl")):
        for line in path.read_text().splitlines():
            record = CompletionRecord.model_validate_json(line)
            if record.turn is None:
                continue
            turns = conversations[(record.dataset, record.prompt_id, record.sample_index)]
            assert record.turn not in turns, f"{record.key}: stored twice"
            turns[record.turn] = record
    counts: dict[str, tuple[int, int]] = {}
    for (dataset, prompt_id, sample), turns in sorted(conversations.items()):
        name = f"{dataset}/{prompt_id}/{sample}"
        assert sorted(turns) == list(range(len(turns))), f"{name}: turns {sorted(turns)} have a gap"
        for turn in range(1, len(turns)):
            history = [m for m in turns[turn].messages if m.role == "assistant"]
            expected = [_answer(turns[earlier]) for earlier in range(turn)]
            assert [_history_answer(m) for m in history] == expected, (
                f"{name} turn {turn}: its history is not the target's stored answers of turns 0..{turn - 1}"
            )
            before = turns[turn - 1].messages
            assert turns[turn].messages[: len(before)] == before, (
                f"{name} turn {turn}: its history does not extend turn {turn - 1}'s request"
            )
        done, total = counts.get(dataset, (0, 0))
        counts[dataset] = (done + 1, total + len(turns))
    return counts


def main() -> None:
    """Check the run folder given; print conversations and turns per dataset."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dir", type=Path, help="runs/<run_id> of a local output root")
    args = parser.parse_args()
    try:
        counts = check(args.run_dir)
    except AssertionError as error:
        print(f"on-policy check FAILED: {error}")
        raise SystemExit(1) from None
    if not counts:
        print(f"on-policy check: {args.run_dir} holds no on-policy conversation")
        raise SystemExit(1)
    for dataset, (conversations, turns) in counts.items():
        print(
            f"on-policy check ok: {dataset}: {conversations} conversations, {turns} turns, histories the target's own"
        )


if __name__ == "__main__":
    main()

"""What SpecForge's and speculators' own preprocessing train on, next to datagen's rows, on the same records.

Makes ``--records`` seeded synthetic completions (``benchmarks/tokenize_data.py``: real Qwen3 vocabulary, a
system prompt on half, thinking on 75%, code, tools and tool round trips, multi-turn histories whose earlier
assistant turns come from the source dataset, 2% truncated), tokenizes them with datagen's merge (truncated
answers kept, ``tokenize.include_truncated``, so every record has a row) and with each trainer's own
preprocessing in its venv (``benchmarks/trainer_preprocess.py``, which says exactly what runs), all with the
real Qwen3 tokenizer and chat template (``tests/support/qwen.py``). Then, record by record, it aligns each
trainer's row for the generated turn with datagen's row (``difflib`` over token ids) and counts:

* rows, tokens and loss tokens of each contender, and rows identical to datagen's;
* system prompt injected: context tokens a template adds to a conversation that had no system prompt;
* newline after the final ``<|im_end|>`` trained;
* earlier assistant turns trained (written by the source dataset, not by the target): in the same row, or as
  extra rows (speculators makes one row per assistant turn);
* pre-filled empty think block trained (``<think>\\n\\n</think>\\n\\n`` of a non-thinking answer, which the
  generation prompt pre-filled and the target never generated);
* fake end of turn trained on truncated answers (``finish_reason: length``: the target produced no
  ``<|im_end|>``);
* generated tokens a trainer does not train (e.g. reasoning its template drops), and anything else;

each with a decoded example (``[[...]]`` marks trained text). Run from the repository root after
``make trainer-venvs``::

    python benchmarks/compare_trainer_masks.py --records 2000 --seed 7

With ``--conversations N`` it compares per-conversation rows instead: ``N`` seeded on-policy conversations
(``benchmarks/tokenize_data.py:make_conversations``, every turn's record made by datagen's own
``Conversation``) merged with ``tokenize.conversation_rows: per_conversation``, and each trainer given each
conversation's last turn's record (the whole conversation, every assistant turn the target's). datagen trains
the earlier turns too there, so what differs is how: a newline after an earlier turn's ``<|im_end|>``, tokens
of earlier turns only one side trains, and (speculators) earlier turns trained in rows of their own instead of
in the conversation's row.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

IM_START, IM_END, NEWLINE = "<|im_start|>", "<|im_end|>", "\n"
EMPTY_THINK = "<think>\n\n</think>\n\n"
CATEGORIES = [
    "system prompt injected (context)",
    "newline after final <|im_end|> trained",
    "newline after an earlier turn's <|im_end|> trained",
    "earlier assistant turns trained (same row)",
    "earlier assistant turns trained (extra rows)",
    "earlier target turns datagen trains, not trained in this row",
    "pre-filled empty think block trained",
    "fake end of turn on truncated answer trained",
    "generated tokens not trained",
    "other trained tokens",
]
Row = tuple[list[int], list[int]]


def datagen_rows(
    records_path: Path, tokenizer: Path, work: Path, conversation_rows: str = "per_turn"
) -> dict[tuple[str, int], Row]:
    """datagen's rows for the records (its merge, truncated answers kept), by (prompt_id, sample_index)."""
    import pyarrow.parquet as pq

    from datagen.config import RunConfig
    from datagen.dataset.merge import merge_and_tokenize
    from datagen.output.layout import RunLayout
    from datagen.output.store import Store
    from datagen.records import ShardSummary

    store, layout = Store(str(work / "store")), RunLayout("compare")
    lines = records_path.read_bytes()
    store.write_bytes(layout.completions("mixed", 0), lines)
    store.write_jsonl(layout.failures("mixed", 0), [])
    done = ShardSummary(
        dataset="mixed",
        shard_index=0,
        requests=0,
        completions=0,
        failures=0,
        prompt_tokens=0,
        completion_tokens=0,
        generation_s=1.0,
        completions_path=layout.completions("mixed", 0),
        failures_path=layout.failures("mixed", 0),
    )
    store.write_json(layout.shard_done("mixed", 0), done)
    config = RunConfig.model_validate(
        {
            "run_id": "compare",
            "model": {"path": str(tokenizer)},
            "datasets": [{"name": "mixed", "format": "openai_messages", "path": "unused"}],
            "output": str(work / "store"),
            "tokenize": {"include_truncated": True, "conversation_rows": conversation_rows},
        }
    )
    summary = merge_and_tokenize(store, layout, config)
    rows: dict[tuple[str, int], Row] = {}
    for part in summary.parts:
        table = pq.read_table(
            part.url, columns=["prompt_id", "sample_index", "input_ids", "loss_mask"]
        ).to_pylist()
        for row in table:
            rows[(row["prompt_id"], row["sample_index"])] = (row["input_ids"], row["loss_mask"])
    if summary.dropped_by_reason:
        print(f"datagen dropped {summary.dropped_by_reason}")
    return rows


def trainer_rows(trainer: str, records: Path, tokenizer: Path, out: Path, *extra: str) -> list[list[Row]]:
    """Each record's rows from the trainer's own preprocessing (in its venv)."""
    from tests.support.trainer_venvs import ensure_venv

    script = Path(__file__).resolve().parent / "trainer_preprocess.py"
    command = [
        str(ensure_venv(trainer)),
        str(script),
        trainer,
        str(records),
        str(tokenizer),
        str(out),
        *extra,
    ]
    # The tokenizer is a local folder: nothing reaches for the Hugging Face Hub.
    subprocess.run(command, check=True, stderr=subprocess.DEVNULL, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    results = [json.loads(line) for line in out.read_text().splitlines()]
    return [[(ids, mask) for ids, mask in result["rows"]] for result in results]


class Decoder:
    """Token ids to text with the Qwen3 tokenizer (special tokens kept)."""

    def __init__(self, tokenizer: Path) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
        self.im_start = self.tokenizer.token_to_id(IM_START)
        self.im_end = self.tokenizer.token_to_id(IM_END)
        self.empty_think = self.tokenizer.encode(EMPTY_THINK, add_special_tokens=False).ids

    def text(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    def marked(self, ids: list[int], mask: list[int], focus: int, window: int = 12) -> str:
        """Decoded text around token ``focus``, trained spans in ``[[...]]``."""
        start, end = max(0, focus - window), min(len(ids), focus + window)
        pieces, trained, current = [], False, []
        for position in range(start, end):
            bit = bool(mask[position])
            if bit != trained and current:
                text = self.text(current)
                pieces.append(f"[[{text}]]" if trained else text)
                current = []
            trained = bit
            current.append(ids[position])
        if current:
            text = self.text(current)
            pieces.append(f"[[{text}]]" if trained else text)
        return ("..." if start else "") + "".join(pieces) + ("..." if end < len(ids) else "")

    def final_turn_start(self, ids: list[int]) -> int:
        """Index of the last ``<|im_start|>assistant`` (the generated turn's header)."""
        for position in range(len(ids) - 1, -1, -1):
            if ids[position] == self.im_start and self.text(ids[position + 1 : position + 2]) == "assistant":
                return position
        return len(ids)


class Tally:
    """Counts of one contender against datagen."""

    def __init__(self) -> None:
        self.rows = self.tokens = self.loss_tokens = self.identical = self.missing = 0
        self.affected: Counter[str] = Counter()
        self.loss_delta: Counter[str] = Counter()
        self.context_tokens: Counter[str] = Counter()
        self.examples: dict[str, str] = {}

    def add_rows(self, rows: list[Row]) -> None:
        for ids, mask in rows:
            self.rows += 1
            self.tokens += len(ids)
            self.loss_tokens += sum(mask)


def compare(record: dict[str, Any], mine: Row, rows: list[Row], decoder: Decoder, tally: Tally) -> None:
    """Classify every difference between a trainer's rows for one record and datagen's row."""
    tally.add_rows(rows)
    if not rows:
        tally.missing += 1
        return
    *earlier, (ids, mask) = rows
    for extra_ids, extra_mask in earlier:
        name = "earlier assistant turns trained (extra rows)"
        tally.affected[name] += 1
        tally.loss_delta[name] += sum(extra_mask)
        first = extra_mask.index(1) if 1 in extra_mask else 0
        tally.examples.setdefault(name, decoder.marked(extra_ids, extra_mask, first))
    if (ids, mask) == mine:
        tally.identical += 1
        return
    my_ids, my_mask = mine
    matcher = difflib.SequenceMatcher(None, my_ids, ids, autojunk=False)
    trained_here = [False] * len(ids)  # trainer-trained tokens that datagen trains too
    mine_matched = [False] * len(my_ids)  # datagen-trained tokens the trainer trains too
    inserted: list[int] = []
    for tag, a0, a1, b0, b1 in matcher.get_opcodes():
        if tag == "equal":
            for offset in range(a1 - a0):
                if my_mask[a0 + offset] and mask[b0 + offset]:
                    trained_here[b0 + offset] = mine_matched[a0 + offset] = True
        elif b1 > b0:
            inserted.extend(range(b0, b1))
    final = decoder.final_turn_start(ids)
    last_end = max((p for p, token in enumerate(ids) if token == decoder.im_end), default=-1)
    has_system = any(message["role"] == "system" for message in record["messages"])
    reasoning = record["completion"].get("reasoning_content")
    seen: set[str] = set()
    empty_think: set[int] = set()
    block = decoder.empty_think
    for start in range(final, len(ids) - len(block) + 1):
        if ids[start : start + len(block)] == block:
            empty_think.update(range(start, start + len(block)))

    def count(name: str, position: int, loss: int = 1) -> None:
        tally.loss_delta[name] += loss
        if name not in seen:
            seen.add(name)
            tally.affected[name] += 1
            tally.examples.setdefault(name, decoder.marked(ids, mask, position))

    system_tokens = [p for p in inserted if p < final and not mask[p]]
    if not has_system and system_tokens and decoder.text(ids[:2]).startswith(f"{IM_START}system"):
        name = "system prompt injected (context)"
        tally.context_tokens[name] += len(system_tokens)
        count(name, system_tokens[0], loss=0)
    for position, bit in enumerate(mask):
        if not bit or trained_here[position]:
            continue
        token = ids[position]
        if (
            position < final
            and position
            and ids[position - 1] == decoder.im_end
            and decoder.text([token]) == NEWLINE
        ):
            count("newline after an earlier turn's <|im_end|> trained", position)
        elif position < final:
            count("earlier assistant turns trained (same row)", position)
        elif position == last_end + 1 and decoder.text([token]) == NEWLINE:
            count("newline after final <|im_end|> trained", position)
        elif token == decoder.im_end and record["finish_reason"] == "length":
            count("fake end of turn on truncated answer trained", position)
        elif not reasoning and position in empty_think:
            count("pre-filled empty think block trained", position)
        else:
            count("other trained tokens", position)
    my_final = decoder.final_turn_start(my_ids)
    for position, bit in enumerate(my_mask):
        if bit and not mine_matched[position]:
            name = "generated tokens not trained"
            if position < my_final:
                name = "earlier target turns datagen trains, not trained in this row"
            tally.loss_delta[name] -= 1
            if name not in seen:
                seen.add(name)
                tally.affected[name] += 1
                tally.examples.setdefault(name, "datagen: " + decoder.marked(my_ids, my_mask, position))


def report(name: str, tally: Tally, base: Tally, records: int) -> None:
    print(f"\n## {name}")
    print(
        f"rows {tally.rows:,} (datagen {base.rows:,}); tokens {tally.tokens:,} (datagen {base.tokens:,}); "
        f"loss tokens {tally.loss_tokens:,} (datagen {base.loss_tokens:,}, "
        f"{(tally.loss_tokens - base.loss_tokens) / base.loss_tokens:+.1%}); generated-turn rows identical to "
        f"datagen's: {tally.identical:,} of {records:,}; records without a row: {tally.missing}"
    )
    print("| difference | records | loss tokens vs datagen | context tokens |")
    print("|---|---:|---:|---:|")
    for category in CATEGORIES:
        if tally.affected[category]:
            print(
                f"| {category} | {tally.affected[category]:,} | {tally.loss_delta[category]:+,} | "
                f"{tally.context_tokens[category] or ''} |"
            )
    for category in CATEGORIES:
        if category in tally.examples:
            print(f"- {category}: {json.dumps(tally.examples[category], ensure_ascii=False)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--template", default="qwen3", choices=["qwen3", "qwen3.6"])
    parser.add_argument(
        "--conversations",
        type=int,
        default=0,
        help="compare per-conversation rows of this many on-policy conversations instead of --records records",
    )
    parser.add_argument(
        "--specforge-template",
        default="qwen3-thinking",
        help="SpecForge TEMPLATE_REGISTRY name for the target",
    )
    args = parser.parse_args()

    from benchmarks.tokenize_data import make_completions, make_conversations
    from tests.support.qwen import build_qwen_tokenizer_dir

    work = Path(tempfile.mkdtemp(prefix="compare-masks-"))
    tokenizer = build_qwen_tokenizer_dir(work / "tokenizer", args.template)
    records_path = work / "records.jsonl"
    started = time.monotonic()
    if args.conversations:
        turns = make_conversations(args.conversations, args.seed)
        turns_path = work / "turns.jsonl"
        turns_path.write_text("".join(record.model_dump_json() + "\n" for record in turns))
        mine = datagen_rows(turns_path, tokenizer, work, "per_conversation")
        # Each conversation's row is its last turn's: the trainers get that record (the whole conversation).
        last = {(record.prompt_id, record.sample_index): record for record in turns}
        records = list(last.values())
        print(f"{len(turns):,} turns of {len(records):,} on-policy conversations, one row per conversation")
    else:
        records = make_completions(args.records, args.seed)
        mine = datagen_rows(records_path, tokenizer, work)
    records_path.write_text("".join(record.model_dump_json() + "\n" for record in records))
    contenders = {
        f"SpecForge 0.2.0, template {args.specforge_template}": trainer_rows(
            "specforge",
            records_path,
            tokenizer,
            work / "specforge.jsonl",
            "--template",
            args.specforge_template,
        ),
        f"SpecForge 0.2.0, template {args.specforge_template}, data.train_only_last_turn=true": trainer_rows(
            "specforge",
            records_path,
            tokenizer,
            work / "specforge-last.jsonl",
            "--template",
            args.specforge_template,
            "--last-turn",
        ),
        "speculators 0.9.0 (prepare-data render path)": trainer_rows(
            "speculators", records_path, tokenizer, work / "speculators.jsonl"
        ),
    }
    decoder = Decoder(tokenizer)
    base = Tally()
    plain = [record.model_dump(mode="json") for record in records]
    keyed = [mine.get((record["prompt_id"], record["sample_index"])) for record in plain]
    base.add_rows([row for row in keyed if row is not None])
    print(
        f"# {len(records):,} records (seed {args.seed}), Qwen3 tokenizer, {args.template} chat template; "
        f"{sum(1 for r in plain if r['finish_reason'] == 'length')} truncated, "
        f"{sum(1 for r in plain if not r['completion'].get('reasoning_content'))} without reasoning, "
        f"{sum(1 for r in plain if not any(m['role'] == 'system' for m in r['messages']))} without a system prompt, "
        f"{sum(1 for r in plain if any(m['role'] == 'assistant' for m in r['messages']))} with earlier assistant turns"
    )
    print(f"datagen: rows {base.rows:,}, tokens {base.tokens:,}, loss tokens {base.loss_tokens:,}")
    for name, per_record in contenders.items():
        tally = Tally()
        for record, row, rows in zip(plain, keyed, per_record, strict=True):
            if row is not None:
                compare(record, row, rows, decoder, tally)
        report(name, tally, base, len(plain))
    print(f"\n({time.monotonic() - started:.0f} s; work folder {work})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

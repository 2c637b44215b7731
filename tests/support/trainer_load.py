"""Run a drafter trainer's own data loading on the command ``datagen export`` printed; dump the rows it reads.

Runs inside a trainer venv (:mod:`tests.support.trainer_venvs`), never imports datagen::

    python trainer_load.py specforge OUT.json TOKENIZER_DIR -- specforge train --config <your-run.yaml> data....
    python trainer_load.py speculators OUT.json TOKENIZER_DIR -- speculators prepare-data ... ;; speculators train ...

* SpecForge 0.2.0: the printed ``specforge train`` overrides are applied by SpecForge's own ``load_config`` to a
  minimal run config (its target is the tokenizer folder), and the rows come from
  ``specforge.data.prompt_builder.prepare_prompt_tasks`` with that config's data settings, as
  ``specforge.training.assembly._prepare_prompts`` calls it (the rest of training needs GPUs).
* speculators 0.9.0: the printed ``prepare-data`` command runs as is (the venv's ``speculators`` console script,
  one preprocessing worker), the printed ``train`` flags are resolved by speculators' own ``TrainConfig``, and
  the rows come from its training dataset class ``ArrowDataset`` over ``--data-path`` (hidden states, which
  need vLLM, are not read).

OUT.json gets ``{"rows": [[input_ids, loss_mask], ...], ...}`` in the order the trainer holds them.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path


def specforge_rows(command: list[str], tokenizer: str, workdir: Path) -> dict[str, object]:
    from specforge.config.schema import load_config
    from specforge.data.prompt_builder import prepare_prompt_tasks

    overrides = command[command.index("--config") + 2 :]
    config_path = workdir / "run.yaml"
    # The smallest run config SpecForge validates; the printed overrides set the data source and length.
    config_path.write_text(
        json.dumps(
            {
                "model": {"target_model_path": tokenizer, "target_backend": "sglang"},
                "data": {"prompts_path": "placeholder.jsonl"},
                "deployment": {
                    "mode": "disaggregated",
                    "disaggregated": {
                        "control_dir": str(workdir / "control"),
                        "backend": "mooncake",
                        "server_urls": ["http://127.0.0.1:1"],
                    },
                },
            }
        )
    )
    config = load_config(str(config_path), overrides)
    tasks = prepare_prompt_tasks(
        config.data.prompts_path,
        None,
        chat_template=config.data.chat_template,
        max_length=config.data.max_length,
        is_preformatted=config.data.is_preformatted,
        train_only_last_turn=config.data.train_only_last_turn,
        cache_dir=config.data.cache_dir,
        cache_key="datagen-export-test",
        num_proc=1,
        max_prompts=config.data.max_prompts,
    )
    rows = [[task["payload"]["input_ids"], task["payload"]["loss_mask"]] for task in tasks]
    return {"rows": rows, "max_length": config.data.max_length, "prompts_path": config.data.prompts_path}


def speculators_rows(commands: list[list[str]], workdir: Path) -> dict[str, object]:
    prepare, train = commands
    assert prepare[:2] == ["speculators", "prepare-data"], prepare
    assert train[:2] == ["speculators", "train"], train
    executable = str(Path(sys.executable).parent / "speculators")
    subprocess.run(
        [executable, *prepare[1:], "--num-preprocessing-workers", "1"],
        cwd=workdir,
        check=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    os.chdir(workdir)
    from speculators.train.config import TrainConfig
    from speculators.train.data import ArrowDataset

    config = TrainConfig.resolve(train[2:])
    dataset = ArrowDataset(max_len=config.data.total_seq_len, datapath=config.data.data_path)
    data = dataset.data.with_format(None)
    rows = [[row["input_ids"], row["loss_mask"]] for row in data]
    return {
        "rows": rows,
        "seq_len": list(data["seq_len"]),
        "total_seq_len": config.data.total_seq_len,
        "approx_lengths": list(dataset.approx_lengths) if hasattr(dataset, "approx_lengths") else None,
    }


def main() -> int:
    trainer, out, tokenizer, separator, *rest = sys.argv[1:]
    assert separator == "--"
    workdir = Path(out).parent
    commands = [shlex.split(part) for part in " ".join(rest).split(";;")]
    if trainer == "specforge":
        result = specforge_rows(commands[0], tokenizer, workdir)
    else:
        result = speculators_rows(commands, workdir)
    Path(out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

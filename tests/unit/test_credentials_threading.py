"""S3 credentials are passed down explicitly: no process default, no path that forgets them.

There is no module global to fall back on: a store, an input read or a scan worker that is not handed the
credentials of the run's Prefect block reaches S3 through the standard AWS chain instead, silently. These
tests read the code of the orchestration and of the core and fail on any such call.
"""

from __future__ import annotations

import ast
from pathlib import Path

from datagen.output.s3_client import S3Credentials
from datagen.prompts.parallel import DatasetScans
from datagen.prompts.scan import CREDENTIALS_ENV, ScanRequest

REPO = Path(__file__).resolve().parents[2]
SECRET = "Sup3rSecret/NeverOnDisk"
# Everything that builds an S3 client or reads an input URL; each call must say with which credentials.
REACHES_S3 = frozenset(
    {
        "Store",
        "open_store",
        "preflight_store",
        "make_s3_client",
        "s3_storage_options",
        "storage_options_for",
        "open_input",
        "input_filesystem",
        "resolve_files",
        "iter_rows",
        "iter_corpus_ids",
        "load_corpus_ids",
        "scan_dataset",
        "DatasetScans",
        "run_preflight",
        "run_host_preflight",
        "run_on_hosts",
    }
)
# Where the AWS chain is meant: the command line (no Prefect block), the config read before the flow has
# loaded its block (the block's name can come with the config), and the quick reachability probe.
CHAIN_ONLY = frozenset(
    {
        ("datagen/app/cli.py", None),
        ("datagen/app/request.py", None),
        ("datagen/prompts/datasets/inspect.py", None),
        ("datagen/app/preflight.py", "check_output_reachable"),
    }
)


def _name(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _passes_credentials(call: ast.Call) -> bool:
    if any(keyword.arg == "credentials" for keyword in call.keywords):
        return True
    return any("credentials" in ast.unparse(argument) for argument in call.args)


def _forgetful_calls(path: Path) -> list[str]:
    where = str(path.relative_to(REPO))
    offences: list[str] = []

    def visit(node: ast.AST, function: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else function
            if (
                isinstance(child, ast.Call)
                and _name(child) in REACHES_S3
                and not _passes_credentials(child)
                and (where, None) not in CHAIN_ONLY
                and (where, function) not in CHAIN_ONLY
            ):
                offences.append(f"{where}:{child.lineno} {ast.unparse(child)[:80]}")
            visit(child, inner)

    visit(ast.parse(path.read_text(encoding="utf-8")), None)
    return offences


def _task_names_with_credentials() -> set[str]:
    names = set()
    for path in (REPO / "tasks").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef) and any(
                isinstance(decorator, ast.Call) and _name(decorator) == "task"
                for decorator in node.decorator_list
            ):
                arguments = [*node.args.args, *node.args.kwonlyargs]
                if any(argument.arg == "credentials" for argument in arguments):
                    names.add(node.name)
    return names


def test_every_store_and_input_read_is_handed_its_credentials() -> None:
    paths = sorted(
        [*(REPO / "datagen").rglob("*.py"), *(REPO / "flows").glob("*.py"), *(REPO / "tasks").glob("*.py")]
    )

    assert [offence for path in paths for offence in _forgetful_calls(path)] == []


def test_the_flows_pass_the_credentials_to_every_task_that_takes_them() -> None:
    tasks = _task_names_with_credentials()
    assert {
        "open_run",
        "prepare_prompts",
        "generate_shard",
        "merge_and_tokenize",
        "finalize_manifest",
    } <= tasks
    offences = []
    for path in sorted((REPO / "flows").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            called = func.value if isinstance(func, ast.Attribute) and func.attr == "submit" else func
            name = getattr(called, "id", None)
            if name in tasks and not any(keyword.arg == "credentials" for keyword in node.keywords):
                offences.append(f"{path.relative_to(REPO)}:{node.lineno} {name}")

    assert offences == []


def test_scan_workers_get_the_credentials_in_their_environment_not_on_disk(tmp_path: Path) -> None:
    credentials = S3Credentials(access_key_id="AKIATEST", secret_access_key=SECRET, session_token="token-1")
    request = ScanRequest(
        dataset="d", format="sharegpt", path="s3://bucket/d.jsonl", multi_turn="last_turn", seed=1
    )

    env = DatasetScans([request], tmp_path, 0, credentials=credentials)._worker_env()
    without = DatasetScans([request], tmp_path, 0)._worker_env()

    assert S3Credentials.model_validate_json(env[CREDENTIALS_ENV]) == credentials
    assert CREDENTIALS_ENV not in without
    assert SECRET not in request.to_json() and SECRET not in repr(credentials)

"""Tokenizer files read and templates rendered without transformers give exactly what transformers gives.

Checked on the real Qwen3 tokenizer with the real Qwen3 and Qwen3.6 templates (``Qwen2Tokenizer``) and on the
tiny model's tokenizer (``TokenizersBackend``): the special-token variables, the template, the token ids, and
every render (with and without the generation prompt, thinking on, off and unset) of conversations with system
prompts, tools, earlier reasoning, parallel tool calls and merged tool responses, and the requests and rows of
on-policy conversations (:mod:`tests.support.on_policy`: the target's own earlier answers, reasoning, a spliced
tool result). Against two transformers
releases: the dev venv's, and the one the GPU serving set pins (``requirements/gpu.txt``), run in a venv of its
own (:mod:`tests.support.transformers_gpu_venv`). Layouts the reader does not know exactly are left to
transformers.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from datagen.dataset.tokenize import APPEND_PROBES, assistant_message
from datagen.dataset.tokenize_template import read_tokenizer_files, render_chat_template
from datagen.dataset.tokenizer import TokenizerSpec, load_tokenizer
from datagen.records import Message
from tests.support import transformers_gpu_venv
from tests.support.on_policy import on_policy_records
from tests.support.qwen import build_qwen_tokenizer_dir
from tests.unit.test_tokenize import make_record

TEXTS = [
    "<|im_start|>user\nHello, wörld! It's 3.14 — naïve café\n<think>\n\n</think>\n\n<|im_end|>\n",
    "def f(x):\n    return x ** 2  # 中文注释\n\n\n   \t trailing  ",
]


@pytest.fixture(scope="module", params=["qwen3", "qwen3.6", "tiny"])
def folder(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Path:
    if request.param == "tiny":
        return tiny_model_dir
    return build_qwen_tokenizer_dir(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def reference(folder: Path) -> Any:
    return load_tokenizer(str(folder))


def _conversations() -> list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]]:
    conversations = []
    for messages, tools, answer in APPEND_PROBES:
        chat = [message.to_chat_dict() for message in messages]
        conversations.append((chat, tools))
        final = Message(
            role="assistant",
            content=answer.content,
            reasoning_content=answer.reasoning_content,
            tool_calls=answer.tool_calls,
        )
        conversations.append(([*chat, final.to_chat_dict()], tools))
    for record in on_policy_records().values():
        chat = [message.to_chat_dict() for message in record.messages]
        conversations.append((chat, record.tools))
        conversations.append(([*chat, assistant_message(record).to_chat_dict()], record.tools))
    return conversations


def test_files_are_read_without_transformers_and_match_it(folder: Path, reference: Any) -> None:
    files = read_tokenizer_files(str(folder))
    assert files is not None
    assert files.chat_template == reference.chat_template
    assert files.special_tokens == reference.special_tokens_map
    spec = TokenizerSpec.load(str(folder))
    ids = [encoding.ids for encoding in spec.backend().encode_batch(TEXTS, add_special_tokens=False)]
    assert ids == reference(TEXTS, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("thinking", [None, True, False])
def test_every_render_equals_apply_chat_template(folder: Path, reference: Any, thinking: bool | None) -> None:
    spec = TokenizerSpec.load(str(folder))
    extra = {} if thinking is None else {"enable_thinking": thinking}
    for messages, tools in _conversations():
        for generation_prompt in (False, True):
            if generation_prompt and messages[-1]["role"] == "assistant":
                continue
            expected = reference.apply_chat_template(
                messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False, **extra
            )
            rendered = spec.render(
                messages, tools=tools, add_generation_prompt=generation_prompt, enable_thinking=thinking
            )
            assert rendered == expected


# Run by the serving set's transformers: what it reads from each tokenizer folder and renders for each job.
RENDER_WITH_TRANSFORMERS = """
import json, sys
import transformers
answers = []
for job in json.load(sys.stdin):
    tokenizer = transformers.AutoTokenizer.from_pretrained(job["folder"], local_files_only=True)
    answers.append({
        "version": transformers.__version__,
        "template": tokenizer.chat_template,
        "special": tokenizer.special_tokens_map,
        "ids": tokenizer(job["texts"], add_special_tokens=False)["input_ids"],
        "renders": [
            tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=prompt, tokenize=False, **extra)
            for messages, tools, prompt, extra in job["renders"]
        ],
    })
print(json.dumps(answers))
"""


def _renders(spec: TokenizerSpec) -> tuple[list[list[Any]], list[str]]:
    """Every render the tests compare, as jobs for transformers and as datagen renders them."""
    jobs: list[list[Any]] = []
    ours: list[str] = []
    for thinking in (None, True, False):
        extra = {} if thinking is None else {"enable_thinking": thinking}
        for messages, tools in _conversations():
            for prompt in (False, True):
                if not (prompt and messages[-1]["role"] == "assistant"):
                    jobs.append([messages, tools, prompt, extra])
                    ours.append(
                        spec.render(
                            messages, tools=tools, add_generation_prompt=prompt, enable_thinking=thinking
                        )
                    )
    for messages, tools, answer in APPEND_PROBES:
        record = make_record(messages, answer, tools=tools)
        chat = [*(message.to_chat_dict() for message in messages), assistant_message(record).to_chat_dict()]
        jobs.append([chat, tools, False, {}])
        ours.append(spec.render(chat, tools=tools, add_generation_prompt=False, enable_thinking=None))
    return jobs, ours


def test_files_and_renders_equal_the_serving_sets_transformers(tmp_path: Path, tiny_model_dir: Path) -> None:
    folders = [build_qwen_tokenizer_dir(tmp_path / name, name) for name in ("qwen3", "qwen3.6")] + [
        tiny_model_dir
    ]
    specs = [TokenizerSpec.load(str(folder)) for folder in folders]
    work = [_renders(spec) for spec in specs]
    jobs = [
        {"folder": str(folder), "texts": TEXTS, "renders": renders}
        for folder, (renders, _) in zip(folders, work, strict=True)
    ]
    answer = subprocess.run(
        [str(transformers_gpu_venv.ensure_venv()), "-c", RENDER_WITH_TRANSFORMERS],
        input=json.dumps(jobs),
        capture_output=True,
        text=True,
        check=True,
    )
    for folder, spec, (_, ours), theirs in zip(folders, specs, work, json.loads(answer.stdout), strict=True):
        assert theirs["version"] == transformers_gpu_venv.gpu_versions()["transformers"]
        files = read_tokenizer_files(str(folder))
        assert files is not None
        assert (files.chat_template, files.special_tokens) == (theirs["template"], theirs["special"])
        ids = [encoding.ids for encoding in spec.backend().encode_batch(TEXTS, add_special_tokens=False)]
        assert ids == theirs["ids"]
        assert len(ours) == len(theirs["renders"]) > 30
        for index, (rendered, expected) in enumerate(zip(ours, theirs["renders"], strict=True)):
            assert rendered == expected, (
                f"{folder.name}: render {index} differs from transformers {theirs['version']}'s"
            )


def test_environment_matches_transformers_extension_filters_and_globals() -> None:
    from transformers.utils.chat_template_utils import render_jinja_template

    template = (
        "{% for m in messages %}{% generation %}{{ m.content | tojson }}{% endgeneration %}{% endfor %}"
        "{% set ns = namespace(n=0) %}{% for i in range(3) %}{% if i == 1 %}{% continue %}{% endif %}"
        "{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}{{ dict(a=1) | tojson(indent=1) }}"
        "{{ (messages[0].thinking or '') + (bos_token or '') }}"
    )
    messages = [{"role": "user", "content": '<é & "q">', "reasoning": "r"}]
    expected = render_jinja_template([messages], chat_template=template, bos_token="<s>")[0][0]
    rendered = render_chat_template(
        template, messages, tools=None, add_generation_prompt=False, variables={"bos_token": "<s>"}
    )
    assert rendered == expected


def test_raise_exception_and_sandbox_refusals_raise() -> None:
    import jinja2

    with pytest.raises(jinja2.TemplateError, match="no user"):
        render_chat_template(
            "{{ raise_exception('no user') }}", [], tools=None, add_generation_prompt=False, variables={}
        )
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_chat_template(
            "{% set ns = namespace() %}{% set ns._x = 1 %}",
            [],
            tools=None,
            add_generation_prompt=False,
            variables={},
        )
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_chat_template(
            "{{ messages.append(1) }}", [], tools=None, add_generation_prompt=False, variables={}
        )


def test_assistant_turn_render_equals_apply_chat_template(folder: Path, reference: Any) -> None:
    spec = TokenizerSpec.load(str(folder))
    for messages, tools, answer in APPEND_PROBES:
        record = make_record(messages, answer, tools=tools)
        chat = [*(message.to_chat_dict() for message in messages), assistant_message(record).to_chat_dict()]
        expected = reference.apply_chat_template(chat, tools=tools, tokenize=False)
        assert spec.render(chat, tools=tools, add_generation_prompt=False, enable_thinking=None) == expected


def _copy(folder: Path, target: Path) -> Path:
    shutil.copytree(folder, target)
    return target


def _edit_config(folder: Path, **changes: Any) -> None:
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def test_layouts_not_known_exactly_are_left_to_transformers(tmp_path: Path) -> None:
    source = build_qwen_tokenizer_dir(tmp_path / "qwen3", "qwen3")
    assert read_tokenizer_files(str(source)) is not None
    assert read_tokenizer_files("Qwen/Qwen3-8B") is None  # a hub id

    other_class = _copy(source, tmp_path / "other-class")
    _edit_config(other_class, tokenizer_class="LlamaTokenizer")
    assert read_tokenizer_files(str(other_class)) is None

    token_object = _copy(source, tmp_path / "token-object")
    _edit_config(token_object, eos_token={"content": "<|im_end|>", "__type": "AddedToken"})
    assert read_tokenizer_files(str(token_object)) is None

    legacy = _copy(source, tmp_path / "legacy")
    _edit_config(legacy, added_tokens_decoder=None)
    (legacy / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    assert read_tokenizer_files(str(legacy)) is None

    named_templates = _copy(source, tmp_path / "named-templates")
    _edit_config(named_templates, chat_template=[{"name": "default", "template": "x"}])
    assert read_tokenizer_files(str(named_templates)) is None

    changed_token = _copy(source, tmp_path / "changed-token")
    config = json.loads((changed_token / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"]["151667"]["normalized"] = True
    (changed_token / "tokenizer_config.json").write_text(json.dumps(config))
    assert read_tokenizer_files(str(changed_token)) is None

    missing_special = _copy(source, tmp_path / "missing-special")
    _edit_config(missing_special, eos_token="<|not_in_vocab|>")
    assert read_tokenizer_files(str(missing_special)) is None


def test_a_chat_template_file_wins_over_the_config(tmp_path: Path) -> None:
    folder = build_qwen_tokenizer_dir(tmp_path / "qwen3", "qwen3")
    (folder / "chat_template.jinja").write_text("{{ messages[0].content }}")
    files = read_tokenizer_files(str(folder))
    assert files is not None
    assert files.chat_template == load_tokenizer(str(folder)).chat_template == "{{ messages[0].content }}"


def test_split_special_tokens_is_left_to_transformers(tmp_path: Path) -> None:
    folder = build_qwen_tokenizer_dir(tmp_path / "qwen3", "qwen3")
    _edit_config(folder, split_special_tokens=True)
    assert read_tokenizer_files(str(folder)) is None

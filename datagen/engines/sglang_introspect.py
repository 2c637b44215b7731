"""Ask an installed sglang what it accepts, in its own interpreter: run as a script, never imported by datagen.

``python sglang_introspect.py flags`` prints the installed sglang's version and every launch-server argparse
action, read from ``ServerArgs.add_cli_args`` on a fresh parser (sglang >= 0.5.2x defines its flags across
``sglang/srt/arg_groups/``, so its source text no longer lists them). ``python sglang_introspect.py check``
reads a JSON request on stdin and answers, for each launch argv, router argv, ``/v1/chat/completions``
body and ``/generate`` body, the error sglang's own parser or request model raises (None when accepted),
along with everything ``flags`` answers for the parser it checked with (one sglang import tells a caller
both which flags it planned with and whether the plans parse).

The file imports nothing from datagen: the serving interpreter (where sglang lives) may not have datagen.
Where GPU-only packages are absent (a CPU CI box, a laptop), ``triton`` and ``torchvision`` are replaced by
sglang's own import stub (``sglang/_platform_stubs.py``, or a copy of it found as the module
``_sglang_platform_stubs`` for releases that predate it); on GPU hosts the real packages are used.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import io
import json
import os
import sys
from typing import Any

# Packages sglang imports at module level that only matter on a GPU (kernels, image decoding).
STUBBED_ROOTS = ("triton", "torchvision", "sgl_kernel", "flashinfer")
STUB_MODULE = "_sglang_platform_stubs"
# Any vocabulary larger than the token ids in the bodies we check (SamplingParams.verify needs one).
VERIFY_VOCAB_SIZE = 1_000_000


def _stub_attribute(owner: str, name: str) -> Any:
    # CamelCase names are classes in every package we stub (torch's inductor subclasses them and uses them in
    # isinstance/except); everything else is a function, constant or submodule.
    full = f"{owner}.{name}"
    if name[:1].isupper():
        return _StubMeta(name, (), {"__module__": owner, "__qualname__": name})
    return _Anything(full)


class _StubMeta(type):
    """Metaclass of stub classes: unknown class attributes (enum members, constants) are stubs too."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _stub_attribute(f"{cls.__module__}.{cls.__qualname__}", name)
        setattr(cls, name, value)
        return value


class _Anything:
    """A value that survives what module-level code does with a stubbed package's names.

    Attribute access, calls (as decorators), subscripts and hashing (dict keys) work; nothing computes.
    """

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _stub_attribute(self._name, name)
        object.__setattr__(self, name, value)
        return value

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # @stub.jit
        # @stub.jit(...) and probes such as triton.runtime.driver.active.get_current_target(): a bare
        # decorator, so attribute lookups on the result fail the way sglang's CPU fallbacks expect.
        return _identity

    def __getitem__(self, key: Any) -> Any:
        return _Anything(f"{self._name}[]")

    def __iter__(self) -> Any:
        return iter(())

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<stub {self._name}>"


class _StubFinder(importlib.abc.Loader):
    """Meta-path finder (and loader) answering imports of absent GPU-only packages with stub modules."""

    def __init__(self, roots: tuple[str, ...]) -> None:
        self.roots = roots

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname.split(".")[0] not in self.roots:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: Any) -> Any:
        return _module_stub(spec.name)

    def exec_module(self, module: Any) -> None:
        parent, _, child = module.__name__.rpartition(".")
        if parent and parent in sys.modules:
            setattr(sys.modules[parent], child, module)


def _identity(function: Any) -> Any:
    return function


def _module_stub(name: str) -> Any:
    import types

    class StubModule(types.ModuleType):
        def __getattr__(self, attribute: str) -> Any:
            if attribute.startswith("__") and attribute.endswith("__"):
                raise AttributeError(attribute)
            value = _stub_attribute(name, attribute)
            setattr(self, attribute, value)
            return value

    module = StubModule(name)
    module.__path__ = []
    module.__version__ = "0.0.0+stub"  # type: ignore[attr-defined]
    return module


def _install_sglang_triton_stub() -> bool:
    """Install sglang's own triton stand-in (written for torch's inductor); False when none is found."""
    spec = importlib.util.find_spec("sglang")
    locations = (spec.submodule_search_locations or []) if spec is not None else []
    candidates = [os.path.join(loc, "_platform_stubs.py") for loc in locations]
    copy = importlib.util.find_spec(STUB_MODULE)
    if copy is not None and copy.origin:
        candidates.append(copy.origin)
    path = next((candidate for candidate in candidates if os.path.isfile(candidate)), None)
    if path is None:
        return False
    stub_spec = importlib.util.spec_from_file_location(STUB_MODULE, path)
    assert stub_spec is not None and stub_spec.loader is not None
    module = importlib.util.module_from_spec(stub_spec)
    sys.modules[STUB_MODULE] = module  # its dataclasses look the module up while they are built
    stub_spec.loader.exec_module(module)
    import platform

    import torch

    # The stub installs itself only on Apple MPS; its triton part is what a CPU box needs too.
    saved = sys.platform, platform.machine, torch.backends.mps.is_available
    sys.platform, platform.machine = "darwin", lambda: "arm64"
    torch.backends.mps.is_available = lambda: True  # type: ignore[assignment]
    try:
        module.install_platform_stubs()
    finally:
        sys.platform, platform.machine, torch.backends.mps.is_available = saved
    return True


def install_stubs() -> list[str]:
    """Stand in for the GPU-only packages that are absent here; returns their names."""
    missing = [root for root in STUBBED_ROOTS if importlib.util.find_spec(root) is None]
    generic = list(missing)
    if "triton" in missing and _install_sglang_triton_stub():
        generic.remove("triton")
    if generic:
        sys.meta_path.insert(0, _StubFinder(tuple(generic)))
    return missing


def server_parser() -> argparse.ArgumentParser:
    """A fresh parser with every flag of ``python -m sglang.launch_server``."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang.launch_server", exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    return parser


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_jsonable(item) for item in value]
    return repr(value)


def describe_flags() -> dict[str, Any]:
    """The installed sglang's version and launch flags (option strings, choices, defaults)."""
    stubbed = install_stubs()
    return _flags_answer(server_parser(), stubbed)


def _flags_answer(parser: argparse.ArgumentParser, stubbed: list[str]) -> dict[str, Any]:
    actions = []
    for action in parser._actions:
        if not action.option_strings or "--help" in action.option_strings:
            continue
        actions.append(
            {
                "option_strings": list(action.option_strings),
                "dest": action.dest,
                "choices": _jsonable(list(action.choices)) if action.choices is not None else None,
                "default": _jsonable(action.default),
                "takes_value": action.nargs != 0,
            }
        )
    return {"sglang_version": importlib.metadata.version("sglang"), "stubbed": stubbed, "actions": actions}


def _refusal(call: Any, argv: list[str]) -> tuple[Any, str | None]:
    """``call(argv)``'s result and None, or None and why it refused ``argv`` (argparse exits on a bad argument)."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return call(argv), None
    except SystemExit:
        lines = stderr.getvalue().strip().splitlines()
        return None, lines[-1] if lines else "exit"
    # argparse.ArgumentError, type conversions, a --config file that cannot be merged
    except Exception as error:
        return None, f"{type(error).__name__}: {error}"


def _parse_error(parse: Any, argv: list[str]) -> str | None:
    return _refusal(parse, argv)[1]


def check(request: dict[str, Any]) -> dict[str, Any]:
    """Validate argvs and request bodies with sglang's own parsers and request models.

    The answer starts with what :func:`describe_flags` answers for the same parser, so a caller that planned
    with a flag list can tell whether it is the one this sglang accepts.
    """
    stubbed = install_stubs()
    parser = server_parser()
    answer = _flags_answer(parser, stubbed)
    answer["server_argvs"] = [
        _parse_error(lambda argv: parser.parse_args(argv), argv) for argv in request.get("server_argvs", [])
    ]
    if request.get("keyed_argvs"):
        answer["api_keys"] = [_api_key_answer(parser, argv) for argv in request["keyed_argvs"]]
    if request.get("auth_checks"):
        answer["auth_checks"] = [_auth_allowed(**check) for check in request["auth_checks"]]
    if request.get("router_argvs"):
        from sglang_router.launch_router import parse_router_args

        answer["router_argvs"] = [_parse_error(parse_router_args, argv) for argv in request["router_argvs"]]
    if request.get("chat_bodies"):
        from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest

        answer["chat_bodies"] = [
            _model_error(lambda body: ChatCompletionRequest.model_validate(body), body)
            for body in request["chat_bodies"]
        ]
    if request.get("generate_bodies"):
        from sglang.srt.managers.io_struct import GenerateReqInput

        answer["generate_bodies"] = [
            _model_error(lambda body: _generate_request(GenerateReqInput, body), body)
            for body in request["generate_bodies"]
        ]
    return answer


def _api_key_answer(parser: argparse.ArgumentParser, argv: list[str]) -> str | dict[str, str] | None:
    """:func:`_api_key_of`, or ``{"error": ...}`` when sglang refuses ``argv``.

    One bad argv is then reported in its own place, not as a crash of the whole check.
    """
    key, error = _refusal(lambda argv: _api_key_of(parser, argv), argv)
    return {"error": error} if error is not None else key


def _api_key_of(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """The API key a server launched with ``argv`` requires, read as ``prepare_server_args`` does."""
    try:  # sglang >= 0.5.2x moved the module under utils
        from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger
    except ImportError:
        from sglang.srt.server_args_config_parser import ConfigArgumentMerger
    if "--config" in argv:
        argv = ConfigArgumentMerger(parser).merge_config_with_args(argv)
    key: str | None = parser.parse_args(argv).api_key
    return key


def _auth_allowed(path: str, authorization: str | None, api_key: str | None) -> bool:
    """Whether sglang's API-key middleware lets a request to ``path`` with this header through."""
    from sglang.srt.utils.auth import AuthLevel, decide_request_auth

    decision = decide_request_auth(
        method="POST" if path in {"/generate", "/v1/chat/completions"} else "GET",
        path=path,
        authorization_header=authorization,
        api_key=api_key,
        admin_api_key=None,
        auth_level=AuthLevel.NORMAL,
    )
    return bool(decision.allowed)


def _generate_request(cls: Any, body: dict[str, Any]) -> Any:
    # What sglang's /generate handler does with the JSON body: build the dataclass, then normalise it.
    unknown = sorted(set(body) - set(cls.__dataclass_fields__))
    if unknown:
        raise TypeError(f"GenerateReqInput has no field(s) {', '.join(unknown)}")
    obj = cls(**body)
    obj.normalize_batch_and_arguments()
    # The scheduler builds SamplingParams from the dict: unknown or ill-typed fields fail there.
    from sglang.srt.sampling.sampling_params import SamplingParams

    params = SamplingParams(**(body.get("sampling_params") or {}))
    params.verify(VERIFY_VOCAB_SIZE)
    return obj


def _model_error(validate: Any, body: dict[str, Any]) -> str | None:
    try:
        validate(body)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return None


def main(argv: list[str]) -> int:
    """Entry point: ``flags`` or ``check`` (JSON request on stdin); prints JSON on stdout."""
    mode = argv[0] if argv else "flags"
    with contextlib.redirect_stdout(sys.stderr):
        # sglang and transformers print warnings on import; stdout carries only the JSON answer.
        result = describe_flags() if mode == "flags" else check(json.load(sys.stdin))
    sys.stdout.write(json.dumps(result))
    return 0


if __name__ == "__main__":
    # Run as a file, this folder is sys.path[0], and datagen/engines/sglang.py would shadow sglang itself.
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)
    sys.exit(main(sys.argv[1:]))

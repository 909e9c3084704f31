"""Tools for multi-turn episodes: parsing a turn's tool calls, loading tools and their schemas (the built-in ones
in `tasks/builtin_tools.py`), and running calls sandboxed.

A policy turn may call tools (`parse_tool_calls`, in the chat template's format); each call runs in a
`ToolPool` worker subprocess, under a timeout and a memory limit, so that a user's tool cannot crash or
stall the generator. A result either goes back to the model as the tool's message (the model's own mistakes
included: an unknown tool, wrong arguments, a malformed call) or is fatal, ending the episode with the reason
(the tool raised, hung, ran out of memory, wrote too much, or killed its worker). A tool is a typed function;
its JSON schema comes from its signature (`tool_schemas`), and a parameter named `problem` receives the
episode's `Problem` without the model seeing it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import json
import re
import threading
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from tasks.base import Problem, TaskError, user_function
from tasks.builtin_tools import BUILTIN_TOOLS, Tool, ToolError
from tasks.sandbox import Handler, SandboxLimits, WorkerPool, WorkerStartError

PROBLEM_PARAMETER = "problem"  # a tool parameter of this name receives the episode's Problem, not a model argument


# ---------------------------------------------------------------- parsing a turn's tool calls


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParsedTurn:
    calls: list[ToolCall]  # the well-formed tool calls of one assistant turn, in order
    malformed: list[str]  # one message per malformed call block, said to the model


_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|\Z)", re.DOTALL)


def _hermes_call(body: str, number: int) -> ToolCall | str:
    """One <tool_call> block's call, or what is wrong with it (said to the model)."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError as error:
        return f"tool call {number} is not valid JSON: {error.msg} at char {error.pos}"
    if not isinstance(call, dict):
        return (
            f'tool call {number} must be a JSON object {{"name": ..., "arguments": {{...}}}}, not {type(call).__name__}'
        )
    name = call.get("name")
    if not isinstance(name, str) or not name:
        return f'tool call {number} has no "name" (the tool to call, as text)'
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some templates write the arguments as a JSON string of an object
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as error:
            return f'tool call {number}: "arguments" is a string but not valid JSON: {error.msg} at char {error.pos}'
    if not isinstance(arguments, dict):
        return f'tool call {number}: "arguments" must be a JSON object, not {type(arguments).__name__}'
    return ToolCall(name, arguments)


def parse_hermes(text: str) -> ParsedTurn:
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks: the Qwen2.5/Qwen3, Hermes and SmolLM3
    templates' format, and vLLM's `hermes` parser's. A block left open at the end of the turn is malformed."""
    calls: list[ToolCall] = []
    malformed: list[str] = []
    for number, block in enumerate(_HERMES_BLOCK.finditer(text), start=1):
        if not block.group(2):
            malformed.append(f"tool call {number} is not closed with </tool_call>")
            continue
        call = _hermes_call(block.group(1).strip(), number)
        if isinstance(call, str):
            malformed.append(call)
        else:
            calls.append(call)
    return ParsedTurn(calls, malformed)


TOOL_CALL_PARSERS: dict[str, Callable[[str], ParsedTurn]] = {"hermes": parse_hermes}


def parse_tool_calls(text: str, parser: str = "hermes") -> ParsedTurn:
    """The tool calls of one assistant turn in the `parser` format (a key of `TOOL_CALL_PARSERS`)."""
    if parser not in TOOL_CALL_PARSERS:
        raise TaskError(f"unknown tool-call format {parser!r}; known: {', '.join(sorted(TOOL_CALL_PARSERS))}")
    return TOOL_CALL_PARSERS[parser](text)


# ---------------------------------------------------------------- loading tools and their schemas


def check_tool_entry(entry: str, where: str) -> str:
    """The tool name an entry gives (a built-in's, or NAME of 'FILE.py:NAME'), without importing anything."""
    if entry in BUILTIN_TOOLS:
        return entry
    source, _, name = entry.rpartition(":")
    if not source or not name.isidentifier():
        raise TaskError(
            f"{where}: {entry!r} is neither a built-in tool ({', '.join(sorted(BUILTIN_TOOLS))}) nor "
            "'FILE.py:NAME' or 'module:NAME'"
        )
    return name


def load_tools(names: Sequence[str], field: str = "environment.tools") -> dict[str, Tool]:
    """Tool name -> function for each entry; an entry that is unknown, fails to import or has a signature no
    schema describes raises `TaskError` naming it (`{field}.{index}`, as job errors name list entries)."""
    tools: dict[str, Tool] = {}
    for index, entry in enumerate(names):
        where = f"{field}.{index}"
        name = check_tool_entry(entry, where)
        if name in tools:
            raise TaskError(f"{where}: a tool named {name!r} is already listed")
        function = BUILTIN_TOOLS[entry] if entry in BUILTIN_TOOLS else user_function(entry, where)
        try:
            tool_schema(name, function)
        except TaskError as error:
            raise TaskError(f"{where}: {error}") from None
        tools[name] = function
    return tools


_JSON_TYPES: dict[Any, str] = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    dict: "object",
    list: "array",
    type(None): "null",
}
_JSON_TYPE_CHECKS: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "null": lambda v: v is None,
}


def _type_schema(hint: Any) -> dict[str, Any]:
    """The JSON schema of a parameter's type hint: str, int, float, bool, dict, list[...], Literal[...], X | None."""
    if hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is list:
        return {"type": "array", "items": _type_schema(args[0])} if args else {"type": "array"}
    if origin is dict:
        return {"type": "object"}
    if origin is Literal and all(type(a) in _JSON_TYPES for a in args):
        return {"type": _JSON_TYPES[type(args[0])], "enum": list(args)}
    if origin in (typing.Union, types.UnionType):  # X | None, or a union of plain types (str | int)
        members = [_type_schema(a) for a in args if a is not type(None)]
        nullable = ["null"] if len(members) < len(args) else []
        if len(members) == 1 and isinstance(members[0]["type"], str):
            return {**members[0], "type": [members[0]["type"], *nullable]}
        if all(set(m) == {"type"} and isinstance(m["type"], str) for m in members):
            return {"type": [*(m["type"] for m in members), *nullable]}
    raise TaskError(
        f"type {hint!r} has no JSON schema here (use str, int, float, bool, list[...], dict, Literal[...] or X | None)"
    )


def tool_schema(name: str, function: Tool) -> dict[str, Any]:
    """OpenAI-style {"type": "function", "function": {...}} from the signature's hints and the docstring's first
    paragraph; parameters without defaults are required; `problem` is left out (the runner passes it)."""
    try:
        hints = typing.get_type_hints(function)
        signature = inspect.signature(function)
    except Exception as error:
        raise TaskError(f"tool {name}: its signature cannot be read: {type(error).__name__}: {error}") from None
    properties: dict[str, Any] = {}
    required: list[str] = []
    for parameter in signature.parameters.values():
        if parameter.name == PROBLEM_PARAMETER:
            continue
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD, parameter.POSITIONAL_ONLY):
            raise TaskError(f"tool {name}: parameter {parameter.name!r} cannot be given by name from JSON")
        if parameter.name not in hints:
            raise TaskError(f"tool {name}: parameter {parameter.name!r} has no type hint (its schema needs one)")
        try:
            properties[parameter.name] = _type_schema(hints[parameter.name])
        except TaskError as error:
            raise TaskError(f"tool {name}: parameter {parameter.name!r}: {error}") from None
        if parameter.default is parameter.empty:
            required.append(parameter.name)
    description = " ".join((inspect.getdoc(function) or "").split("\n\n")[0].split())
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def tool_schemas(tools: dict[str, Tool]) -> list[dict[str, Any]]:
    """Each tool's schema, in order: for `tokenizer.apply_chat_template(tools=...)` and `tools_prompt`."""
    return [tool_schema(name, function) for name, function in tools.items()]


def tools_prompt(schemas: list[dict[str, Any]]) -> str:
    """A system message describing the tools and the hermes call format (the Qwen2.5 template's own words), for
    chat templates that do not render `tools` themselves."""
    listed = "\n".join(json.dumps(schema) for schema in schemas)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def _argument_problem(value: Any, schema: dict[str, Any]) -> str | None:
    """Why `value` does not fit the parameter's JSON schema, or None."""
    allowed = schema.get("type")
    allowed_types = [allowed] if isinstance(allowed, str) else allowed or []
    if allowed_types and not any(_JSON_TYPE_CHECKS[t](value) for t in allowed_types):
        return f"must be {' or '.join(allowed_types)}, got {json.dumps(value)[:80]}"
    if value is None:  # allowed by its type, so the parameter is nullable
        return None
    if "enum" in schema and value not in schema["enum"]:
        return f"must be one of {json.dumps(schema['enum'])}, got {json.dumps(value)[:80]}"
    if "items" in schema and isinstance(value, list):
        return next(
            (
                f"item {i} {problem}"
                for i, item in enumerate(value)
                if (problem := _argument_problem(item, schema["items"])) is not None
            ),
            None,
        )
    return None


# ---------------------------------------------------------------- running calls


@dataclass(frozen=True)
class ToolResult:
    content: str  # the tool message's content the model reads next (for an error, the error said plainly)
    error: str | None = None  # why the call gave no result; None when it did
    fatal: bool = False  # the episode cannot go on (the tool raised, hung, ran out of memory, wrote too much, died)


class _CountingSink(io.TextIOBase):
    """Where a tool's prints go: counted (a flood is fatal), never kept."""

    def __init__(self) -> None:
        self.chars = 0

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.chars += len(text)
        return len(text)


def _content(value: Any) -> str:
    """A tool's return value as the model reads it: text as is, JSON for a dict or list, str() otherwise."""
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list)):
        try:
            return json.dumps(value)
        except (TypeError, ValueError):
            return str(value)
    return str(value)


def _said(error: str, fatal: bool = False) -> ToolResult:
    return ToolResult(f"error: {error}", error, fatal)


class ToolRunner:
    """Runs tool calls in this process, each error turned into a result: the work of a `ToolPool` worker, and
    an inline runner (no timeout, no memory limit) for tests and trusted tools."""

    def __init__(self, tools: dict[str, Tool], max_output_chars: int = 4096) -> None:
        self.tools, self.max_output_chars = tools, max_output_chars
        self.schemas = {
            name: tool_schema(name, function)["function"]["parameters"]["properties"]
            for name, function in tools.items()
        }
        self.wants_problem = {
            name: PROBLEM_PARAMETER in inspect.signature(function).parameters for name, function in tools.items()
        }

    def __call__(self, call: ToolCall, problem: Problem) -> ToolResult:
        if call.name not in self.tools:
            return _said(f"unknown tool {call.name!r}; the tools are {', '.join(self.tools)}")
        function = self.tools[call.name]
        if PROBLEM_PARAMETER in call.arguments and PROBLEM_PARAMETER not in self.schemas[call.name]:
            return _said(f"tool {call.name} got an unexpected argument {PROBLEM_PARAMETER!r}")
        arguments = {**call.arguments, PROBLEM_PARAMETER: problem} if self.wants_problem[call.name] else call.arguments
        try:
            bound = inspect.signature(function).bind(**arguments)
        except TypeError as error:
            return _said(f"tool {call.name}: {error}")
        for name, value in call.arguments.items():
            problem_text = _argument_problem(value, self.schemas[call.name][name])
            if problem_text is not None:
                return _said(f"tool {call.name}: argument {name!r} {problem_text}")
        return self._run(call.name, function, bound)

    def _run(self, name: str, function: Tool, bound: inspect.BoundArguments) -> ToolResult:
        printed = _CountingSink()
        try:
            with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
                value = function(*bound.args, **bound.kwargs)
            content = _content(value)
        except ToolError as error:
            return _said(str(error))
        except MemoryError:
            return _said(f"tool {name} ran out of memory", fatal=True)
        except BaseException as error:
            return _said(f"tool {name} raised {type(error).__name__}: {error}"[:300], fatal=True)
        if printed.chars > self.max_output_chars:
            return _said(
                f"tool {name} printed {printed.chars} chars, over max_output_chars {self.max_output_chars}", fatal=True
            )
        if len(content) > self.max_output_chars:
            return _said(
                f"tool {name} returned {len(content)} chars, over max_output_chars {self.max_output_chars}", fatal=True
            )
        return ToolResult(content)


class ToolWorkerError(WorkerStartError):
    """A tool worker could not start (a tool file that fails to import there, say): no call could run."""


def _build_tool_runner(names: tuple[str, ...], field: str, max_output_chars: int) -> Handler:
    """A worker's handler: (call, problem) -> its `ToolResult`, the tools loaded (user files imported) here."""
    runner = ToolRunner(load_tools(names, field), max_output_chars)
    return lambda item: runner(*item)


class ToolPool(WorkerPool[ToolResult]):
    """Tool calls run in `workers` sandboxed subprocesses (`tasks.sandbox`, as the reward workers): each call
    under `timeout_s`, a worker's address space capped at `memory_limit_mb` over its start-up footprint, a
    hung or dead worker killed and replaced, SIGINT ignored; a worker that cannot load the tools within
    `startup_timeout_s` raises `ToolWorkerError`.

    `calls_run` counts calls, `failures` the fatal results, `call_errors` the model's mistakes (non-fatal)."""

    start_error = ToolWorkerError
    timeout_reason = "timed out after {timeout_s:g} s"
    died_reason = "killed its worker (it died or ran out of memory)"
    output_reason = "wrote more than {limit} bytes to stdout/stderr (max_output_chars)"

    def __init__(
        self,
        tool_names: Sequence[str],
        workers: int = 1,
        timeout_s: float = 5.0,
        memory_limit_mb: int | None = 1024,
        max_output_chars: int = 4096,
        startup_timeout_s: float = 120.0,
        field: str = "environment.tools",
        limits: SandboxLimits | None = None,
    ) -> None:
        for index, entry in enumerate(tool_names):  # a misspelt entry fails here, before any worker starts
            check_tool_entry(entry, f"{field}.{index}")
        limits = dataclasses.replace(limits or SandboxLimits(), max_output_chars=max_output_chars)
        super().__init__(
            _build_tool_runner,
            (tuple(tool_names), field, max_output_chars),
            workers,
            timeout_s,
            memory_limit_mb,
            startup_timeout_s,
            describe=f"tool worker for {field}",
            startup_setting="ToolPool startup_timeout_s",
            limits=limits,
        )
        self.calls_run = self.failures = self.call_errors = 0
        self._counting = threading.Lock()  # a streaming generator's episodes call from threads of their own

    def run_many(self, calls: Sequence[tuple[ToolCall, Problem]]) -> list[ToolResult]:
        """Each call's result, in order, the calls spread over the workers that are free: the episodes of a
        streaming generator call from threads of their own, and run at once up to `workers` calls in all."""
        results = self.run_items(calls, lambda index, reason: _said(f"tool {calls[index][0].name} {reason}", True))
        with self._counting:
            self.calls_run += len(results)
            self.failures += sum(r.fatal for r in results)
            self.call_errors += sum(r.error is not None and not r.fatal for r in results)
        return results

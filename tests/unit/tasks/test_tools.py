"""Tools of multi-turn episodes: parsing calls, the built-in tools, schemas, loading, and the sandboxed pool."""

import json
import time
from itertools import islice
from typing import Literal

import pytest

from tasks.base import Problem, TaskError
from tasks.builtin_tools import BUILTIN_TOOLS, ToolError, calculator, countdown_check
from tasks.config import CountdownConfig
from tasks.countdown import Countdown
from tasks.tools import (
    ToolCall,
    ToolPool,
    ToolRunner,
    ToolWorkerError,
    load_tools,
    parse_tool_calls,
    tool_schemas,
    tools_prompt,
)

# ---------------------------------------------------------------- parsing


def _block(call: object) -> str:
    return f"<tool_call>{json.dumps(call)}</tool_call>"


def test_well_formed_calls_are_parsed_in_order_with_arguments_as_object_or_json_string():
    text = (
        "Let me compute.\n"
        + _block({"name": "calculator", "arguments": {"expression": "1 + 2"}})
        + "\nand\n"
        + _block({"name": "lookup", "arguments": json.dumps({"ids": [1, 2]})})
        + "\n"
        + '<tool_call>\n{"name": "noargs"}\n</tool_call>'
    )
    parsed = parse_tool_calls(text)
    assert parsed.calls == [
        ToolCall("calculator", {"expression": "1 + 2"}),
        ToolCall("lookup", {"ids": [1, 2]}),
        ToolCall("noargs", {}),
    ]
    assert parsed.malformed == []


def test_text_without_calls_has_none():
    parsed = parse_tool_calls("The answer is <answer>4</answer>, no tools needed.")
    assert parsed.calls == [] and parsed.malformed == []


def test_each_malformed_block_gets_its_own_message_and_the_good_ones_still_count():
    text = (
        _block({"name": "calculator", "arguments": {"expression": "1"}})
        + '<tool_call>{"name": "calculator" "arguments": {}}</tool_call>'  # 2: a comma missing
        + _block({"arguments": {"expression": "1"}})  # 3: no name
        + _block(["calculator"])  # 4: not an object
        + _block({"name": "calculator", "arguments": [1]})  # 5: arguments not an object
        + _block({"name": "calculator", "arguments": "{oops"})  # 6: arguments string not JSON
        + _block({"name": "calculator", "arguments": {"expression": "2"}})
        + '<tool_call>{"name": "calculator", "arguments": {"expr'
    )  # 8: cut off at the end of the turn
    parsed = parse_tool_calls(text, "hermes")
    assert parsed.calls == [ToolCall("calculator", {"expression": "1"}), ToolCall("calculator", {"expression": "2"})]
    assert parsed.malformed == [
        "tool call 2 is not valid JSON: Expecting ',' delimiter at char 22",
        'tool call 3 has no "name" (the tool to call, as text)',
        'tool call 4 must be a JSON object {"name": ..., "arguments": {...}}, not list',
        'tool call 5: "arguments" must be a JSON object, not list',
        'tool call 6: "arguments" is a string but not valid JSON: Expecting property name enclosed in double '
        "quotes at char 1",
        "tool call 8 is not closed with </tool_call>",
    ]


def test_an_unknown_parser_is_named():
    with pytest.raises(TaskError, match="unknown tool-call format 'json'; known: hermes"):
        parse_tool_calls("", "json")


# ---------------------------------------------------------------- calculator


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("1 + 2 * 3", "7"),
        ("(1 + 2) * 3", "9"),
        ("2 ** 3 ** 2", "512"),
        ("-3 ** 2", "-9"),
        ("(-3) ** 2", "9"),
        ("7 / 2", "3.5"),
        ("6 / 3", "2"),
        ("0.5 * 4", "2"),
        ("7 // 2", "3"),
        ("-7 % 3", "2"),
        ("2 ** -1", "0.5"),
        ("0.1 + 0.2", "0.3"),
        ("1 / 3", "0.333333333333333"),
        ("10 ** 20", "100000000000000000000"),
        ("+4 - -1", "5"),
    ],
)
def test_calculator_does_arithmetic_with_python_precedence(expression, expected):
    assert calculator(expression) == expected


@pytest.mark.parametrize(
    ("expression", "reason"),
    [
        ("x + 1", "not allowed: names"),
        ("(1).real", "not allowed: attributes"),
        ("__import__('os').system('true')", "not allowed: function calls"),
        ("'a' * 3", "constants other than numbers"),
        ("1 +", "not an expression"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("9 ** 9 ** 9", "result too large"),
        ("2 ** 100000", "result too large"),
        ("(10 ** 1000) ** 1000", "too large"),
        ("1e308 * 10", "the result is inf"),
        ("(-8) ** 0.5", "no real value"),
        ("1" * 1001, "longer than 1000"),
    ],
)
def test_calculator_refuses_what_is_not_bounded_arithmetic_quickly(expression, reason):
    start = time.monotonic()
    with pytest.raises(ToolError, match=reason):
        calculator(expression)
    assert time.monotonic() - start < 0.5


def test_a_refused_expression_is_an_error_said_to_the_model_not_a_fatal_one():
    runner = ToolRunner(load_tools(["calculator"]))
    result = runner(ToolCall("calculator", {"expression": "9 ** 9 ** 9"}), Problem("p", "q", "a"))
    assert result.fatal is False and result.error.startswith("result too large")
    assert result.content == f"error: {result.error}"
    assert runner(ToolCall("calculator", {"expression": "2 * 21"}), Problem("p", "q", "a")).content == "42"


# ---------------------------------------------------------------- countdown_check


def _countdown(numbers: list[int], target: int, solution: str) -> Problem:
    """A problem shaped as `Countdown.problems` makes them."""
    return Problem("countdown-test-000000", "q", solution, {"numbers": numbers, "target": target, "solution": solution})


def test_countdown_check_accepts_the_generated_solutions():
    for problem in islice(Countdown(CountdownConfig()).problems("train", 0), 5):
        solution = problem.metadata["solution"]
        assert countdown_check(solution, problem) == f"correct: {solution} = {problem.metadata['target']}"


@pytest.mark.parametrize(
    ("expression", "verdict"),
    [
        ("3 * 5 + 7", "correct: 3 * 5 + 7 = 22"),
        ("3 + 5 + 7", "wrong: 3 + 5 + 7: equals 15, not 22"),
        (
            "3 * 7 + 7",
            "wrong: 3 * 7 + 7: uses 5 0 time(s) but it is given 1 time(s); "
            "uses 7 2 time(s) but it is given 1 time(s); equals 28, not 22",
        ),
        ("3 * 5 + 7 + 0", "wrong: 3 * 5 + 7 + 0: uses 0 1 time(s) but it is given 0 time(s)"),
        (
            "(5 + 7) * 2 - 2",
            "wrong: (5 + 7) * 2 - 2: uses 2 2 time(s) but it is given 0 time(s); "
            "uses 3 0 time(s) but it is given 1 time(s)",
        ),
        (
            "44 / 2",
            "wrong: 44 / 2: uses 2 1 time(s) but it is given 0 time(s); uses 3 0 time(s) but it is given 1 "
            "time(s); uses 5 0 time(s) but it is given 1 time(s); uses 7 0 time(s) but it is given 1 time(s); "
            "uses 44 1 time(s) but it is given 0 time(s)",
        ),
    ],
)
def test_countdown_check_says_what_is_wrong(expression, verdict):
    assert countdown_check(expression, _countdown([3, 5, 7], 22, "((3 * 5) + 7)")) == verdict


def test_countdown_check_refuses_what_is_not_an_expression_and_needs_a_countdown_problem():
    with pytest.raises(ToolError, match="only digits"):
        countdown_check("3 * x", _countdown([3, 5, 7], 22, "((3 * 5) + 7)"))
    with pytest.raises(TaskError, match="needs a countdown problem"):
        countdown_check("1 + 1", Problem("arithmetic-1", "What is 1 + 1?", "2"))


# ---------------------------------------------------------------- schemas and loading


def search(
    query: str,
    ids: list[int],
    limit: int = 5,
    tags: list[str] | None = None,
    mode: Literal["fast", "full"] = "fast",
    scale: float = 1.0,
    exact: bool = False,
    key: str | int = 0,
    problem: Problem | None = None,
) -> str:
    """Search the index for a query.

    Everything after the first paragraph stays out of the description."""
    return query


def test_schemas_come_from_the_signature_and_the_docstring():
    (schema,) = tool_schemas({"search": search})
    assert schema == {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the index for a query.",
            "parameters": {
                "type": "object",
                "required": ["query", "ids"],
                "properties": {
                    "query": {"type": "string"},
                    "ids": {"type": "array", "items": {"type": "integer"}},
                    "limit": {"type": "integer"},
                    "tags": {"type": ["array", "null"], "items": {"type": "string"}},
                    "mode": {"type": "string", "enum": ["fast", "full"]},
                    "scale": {"type": "number"},
                    "exact": {"type": "boolean"},
                    "key": {"type": ["string", "integer"]},
                },
            },
        },
    }
    assert [s["function"]["parameters"]["required"] for s in tool_schemas(load_tools(list(BUILTIN_TOOLS)))] == [
        ["expression"],
        ["expression"],
    ]  # countdown_check's problem is the runner's to give


def test_the_tools_prompt_lists_the_schemas_and_the_call_format():
    schemas = tool_schemas(load_tools(["calculator"]))
    prompt = tools_prompt(schemas)
    assert json.dumps(schemas[0]) in prompt
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in prompt


def _write(path, text):
    path.write_text(text)
    return str(path)


def test_load_tools_loads_a_users_file_and_the_built_ins(tmp_path):
    source = _write(
        tmp_path / "my_tools.py",
        "from tasks.base import Problem\n\n"
        "def answer_length(problem: Problem, extra: int = 0) -> int:\n"
        "    '''The length of the answer.'''\n    return len(problem.answer) + extra\n",
    )
    tools = load_tools(["calculator", f"{source}:answer_length", "tasks.countdown:solve"])
    assert list(tools) == ["calculator", "answer_length", "solve"]
    runner = ToolRunner(tools)
    assert runner(ToolCall("answer_length", {"extra": 1}), Problem("p", "q", "four")).content == "5"
    assert runner(ToolCall("solve", {"numbers": [3, 5], "target": 8}), Problem("p", "q", "a")).content == "(3 + 5)"


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        (
            ["calculator", "nope"],
            r"^environment\.tools\.1: 'nope' is neither a built-in tool \(calculator, "
            r"countdown_check\) nor 'FILE.py:NAME' or 'module:NAME'$",
        ),
        (["{dir}/missing.py:f"], r"^environment\.tools\.0: no file .*missing\.py$"),
        (["{dir}/broken.py:f"], r"^environment\.tools\.0: importing .*broken\.py' failed: ZeroDivisionError"),
        (["no_such_module_here:f"], r"^environment\.tools\.0: importing 'no_such_module_here' failed"),
        (["{dir}/good.py:absent"], r"^environment\.tools\.0: .*good\.py' has no function 'absent'$"),
        (["calculator", "{dir}/good.py:calculator"], r"^environment\.tools\.1: a tool named 'calculator' is already"),
        (["{dir}/good.py:untyped"], r"^environment\.tools\.0: tool untyped: parameter 'x' has no type hint"),
        (["{dir}/good.py:setty"], r"^environment\.tools\.0: tool setty: parameter 'x': type set\[int\] has no JSON "),
        (["{dir}/good.py:starry"], r"^environment\.tools\.0: tool starry: parameter 'args' cannot be given by name"),
    ],
)
def test_load_tools_errors_name_the_entry(tmp_path, entries, message):
    _write(tmp_path / "broken.py", "1 / 0\n")
    _write(
        tmp_path / "good.py",
        "def calculator(expression: str) -> str:\n    return expression\n\n"
        "def untyped(x):\n    return x\n\n"
        "def setty(x: set[int]) -> str:\n    return ''\n\n"
        "def starry(*args: int) -> str:\n    return ''\n",
    )
    with pytest.raises(TaskError, match=message):
        load_tools([entry.format(dir=tmp_path) for entry in entries])


def test_the_field_prefix_is_the_callers():
    with pytest.raises(TaskError, match=r"^job\.my_tools\.0: 'nope'"):
        load_tools(["nope"], "job.my_tools")
    with pytest.raises(TaskError, match=r"^job\.my_tools\.0: 'nope'"):
        ToolPool(["nope"], field="job.my_tools")  # refused before any worker starts


def test_the_model_s_mistakes_are_said_to_it_not_fatal():
    runner = ToolRunner(load_tools(["calculator", "countdown_check"]))
    problem = _countdown([3, 5, 7], 22, "((3 * 5) + 7)")
    cases = [
        (
            ToolCall("calculater", {"expression": "1"}),
            "unknown tool 'calculater'; the tools are calculator, countdown_check",
        ),
        (ToolCall("calculator", {}), "tool calculator: missing a required argument: 'expression'"),
        (
            ToolCall("calculator", {"expression": "1", "x": 2}),
            "tool calculator: got an unexpected keyword argument 'x'",
        ),
        (ToolCall("calculator", {"expression": 5}), "tool calculator: argument 'expression' must be string, got 5"),
        (
            ToolCall("countdown_check", {"expression": "1", "problem": "p"}),
            "tool countdown_check got an unexpected argument 'problem'",
        ),
    ]
    for call, error in cases:
        result = runner(call, problem)
        assert (result.error, result.fatal, result.content) == (error, False, f"error: {error}")
    assert runner(ToolCall("countdown_check", {"expression": "3*5+7"}), problem).content == "correct: 3*5+7 = 22"


# ---------------------------------------------------------------- the sandboxed pool

USER_TOOLS = """
import os
import time


def echo(text: str, times: int = 1) -> str:
    '''Repeat text.'''
    return text * times


def numbers(count: int) -> list:
    '''Count up.'''
    return list(range(count))


def boom(x: int) -> str:
    '''Raise.'''
    raise ValueError(f"bad x {x}")


def slow(seconds: float) -> str:
    '''Sleep.'''
    time.sleep(seconds)
    return "slept"


def spam() -> str:
    '''Print 10 MB.'''
    print("x" * (10 << 20), end="")
    return "done"


def big() -> str:
    '''Return 10 MB.'''
    return "y" * (10 << 20)


def die() -> str:
    '''Kill its own process.'''
    os._exit(3)


def hog() -> str:
    '''Allocate 8 GiB.'''
    return str(len(bytearray(8 << 30)))
"""

NAMES = ("echo", "numbers", "boom", "slow", "spam", "big", "die", "hog")
PROBLEM = Problem("p", "q", "a")


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    source = _write(tmp_path_factory.mktemp("tools") / "user_tools.py", USER_TOOLS)
    with ToolPool(
        ["calculator", *(f"{source}:{name}" for name in NAMES)],
        workers=2,
        timeout_s=1.0,
        memory_limit_mb=256,
        max_output_chars=4096,
    ) as tool_pool:
        yield tool_pool


def _calls(*calls: tuple[str, dict]) -> list[tuple[ToolCall, Problem]]:
    return [(ToolCall(name, arguments), PROBLEM) for name, arguments in calls]


def test_results_come_in_order_across_two_workers(pool):
    calls = _calls(
        *(("calculator", {"expression": f"{i} * 10"}) for i in range(7)),
        ("numbers", {"count": 3}),
        ("echo", {"text": "ab", "times": 2}),
    )
    before = pool.calls_run
    results = pool.run_many(calls)
    assert [r.content for r in results] == [str(i * 10) for i in range(7)] + ["[0, 1, 2]", "abab"]
    assert all(r.error is None and not r.fatal for r in results) and pool.calls_run == before + 9
    pids = {worker.process.pid for worker in pool._workers}
    assert len(pids) == 2


def test_unknown_tools_and_bad_arguments_are_said_to_the_model_and_kill_no_worker(pool):
    pids = [worker.process.pid for worker in pool._workers]
    errors_before, failures_before = pool.call_errors, pool.failures
    results = pool.run_many(_calls(("nope", {}), ("echo", {"text": 1}), ("echo", {}), ("echo", {"text": "k"})))
    assert [(r.error, r.fatal) for r in results[:3]] == [
        (f"unknown tool 'nope'; the tools are calculator, {', '.join(NAMES)}", False),
        ("tool echo: argument 'text' must be string, got 1", False),
        ("tool echo: missing a required argument: 'text'", False),
    ]
    assert results[3].content == "k"
    assert [worker.process.pid for worker in pool._workers] == pids
    assert (pool.call_errors, pool.failures) == (errors_before + 3, failures_before)


def test_a_tool_that_raises_is_fatal_with_the_reason(pool):
    (result,) = pool.run_many(_calls(("boom", {"x": 7})))
    assert (result.error, result.fatal) == ("tool boom raised ValueError: bad x 7", True)
    assert result.content == "error: tool boom raised ValueError: bad x 7"


def test_a_hanging_tool_is_fatal_after_the_timeout_and_the_pool_still_works(pool):
    failures_before = pool.failures
    start = time.monotonic()
    results = pool.run_many(_calls(("slow", {"seconds": 60}), ("slow", {"seconds": 0.01})))
    elapsed = time.monotonic() - start
    assert (results[0].error, results[0].fatal) == ("tool slow timed out after 1 s", True)
    assert results[1].content == "slept" and 1.0 <= elapsed < 10
    assert pool.failures == failures_before + 1
    assert [r.content for r in pool.run_many(_calls(*[("calculator", {"expression": "2 + 2"})] * 3))] == ["4"] * 3


def test_a_tool_that_prints_10_mb_is_fatal_and_the_pool_still_works(pool):
    (result,) = pool.run_many(_calls(("spam", {})))
    assert (result.error, result.fatal) == ("tool spam printed 10485760 chars, over max_output_chars 4096", True)
    assert [r.content for r in pool.run_many(_calls(("echo", {"text": "still here"})))] == ["still here"]


def test_a_tool_that_returns_10_mb_is_fatal(pool):
    (result,) = pool.run_many(_calls(("big", {})))
    assert (result.error, result.fatal) == ("tool big returned 10485760 chars, over max_output_chars 4096", True)


def test_a_tool_that_kills_its_process_is_fatal_and_the_worker_goes_on(pool):
    # each call runs in a process forked from the worker: the call dies, the worker serves the next ones
    pids = {worker.process.pid for worker in pool._workers}
    results = pool.run_many(_calls(("die", {}), ("echo", {"text": "a"}), ("echo", {"text": "b"})))
    assert (results[0].error, results[0].fatal) == ("tool die killed its worker (it died or ran out of memory)", True)
    assert [r.content for r in results[1:]] == ["a", "b"]
    assert {worker.process.pid for worker in pool._workers} == pids


def test_a_tool_that_exhausts_memory_is_fatal_under_the_limit(pool):
    (result,) = pool.run_many(_calls(("hog", {})))
    assert (result.error, result.fatal) == ("tool hog ran out of memory", True)
    assert pool.run_many(_calls(("calculator", {"expression": "6 * 7"})))[0].content == "42"


def test_a_tool_file_that_fails_in_the_worker_stops_the_pool_with_the_entry(tmp_path):
    source = _write(
        tmp_path / "fails_there.py", "raise RuntimeError('no GPU here')\n\ndef f() -> str:\n    return ''\n"
    )
    with (
        ToolPool([f"{source}:f"], field="job.tools") as pool,
        pytest.raises(
            ToolWorkerError,
            match=r"tool worker for job\.tools failed to start: TaskError: "
            r"job\.tools\.0: importing .* failed: RuntimeError: no GPU here",
        ),
    ):
        pool.run_many(_calls(("f", {})))

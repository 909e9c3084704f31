"""The task contract: problems, chat messages, a demonstration, and a score that never raises."""

from __future__ import annotations

import gzip
import importlib
import importlib.util
import itertools
import json
import random
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from algorithms.errors import StableAsyncError

ANSWER_FORMAT = "Reply with the final answer inside <answer></answer> tags."
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# \boxed{..} or \fbox{..}, and \boxed 5 (a box of one token, as math-verify and lighteval read it)
_BOXED = re.compile(r"\\(?:boxed|fbox)(?:\s*(\{)|\s+(?=[^\s{]))")
_BARE_TOKEN = re.compile(r"[^\s$]+")
_BRACE_DEPTH = {"{": 1, "}": -1}


CYCLING_SPLITS = ("train", "sft")  # the splits drawn for as long as a run lasts


class TaskError(StableAsyncError, ValueError):
    """Bad task input (a data file, a row, a reward function): the message names the field, file and line."""


@dataclass(frozen=True)
class Problem:
    problem_id: str
    question: str
    answer: str
    metadata: dict[str, Any] = field(default_factory=dict)


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """A tool call as the hermes format writes it (`tasks.tools`), for tasks' demonstrated episodes."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def last_answer(completion: str) -> str | None:
    """The content of the last <answer>...</answer>, or None when there is none."""
    found = _ANSWER.findall(completion)
    return found[-1].strip() if found else None


def last_boxed(completion: str) -> str | None:
    """The content of the last box (\\boxed{...} with nested braces, \\fbox{...}, or \\boxed 5), or None when
    there is none or the last one never closes: math models (and MATH-500 or AIME style prompts) give their
    final answer so, and a box cut off by the length limit is no answer, not a cue to read an earlier one."""
    boxes = list(_BOXED.finditer(completion))
    if not boxes:
        return None
    last = boxes[-1]
    if last.group(1) is None:  # \boxed 5: the token after it, without a sentence's closing punctuation
        token = _BARE_TOKEN.match(completion, last.end())
        return token.group(0).rstrip(".,;") if token else None
    depth = 1
    for index in range(last.end(), len(completion)):
        depth += _BRACE_DEPTH.get(completion[index], 0)
        if depth == 0:
            return completion[last.end() : index].strip()
    return None


def final_answer(completion: str) -> str | None:
    """A completion's final answer as a reader takes it: the last <answer></answer>, else the last box."""
    answer = last_answer(completion)
    return answer if answer is not None else last_boxed(completion)


def graded_answer(completion: str, is_correct: Callable[[str], bool], boxed: bool = False) -> float:
    """The reward scale of the built-in verifiers, from the last <answer></answer> (with `boxed`, for the
    math-verified ones, from the last \\boxed{} when there is no such tag): 1.0 when `is_correct` says so,
    0.1 for a well-formed but wrong answer, 0.0 without one."""
    answer = last_answer(completion)
    if answer is None and boxed:
        answer = last_boxed(completion)
    if answer is None:
        return 0.0
    return 1.0 if is_correct(answer) else 0.1


class Task:
    """Base class: subclasses set `name` and implement problems, score and demonstration."""

    name = ""

    def problems(self, split: str, seed: int) -> Iterator[Problem]:
        raise NotImplementedError

    def score(self, problem: Problem, completion: str) -> float:
        """1.0 correct, 0.1 well-formed but wrong, 0.0 otherwise; never raises on any text."""
        raise NotImplementedError

    def demonstration(self, problem: Problem) -> str:
        """A correct completion in the exact format `score` accepts (for supervised warm-up)."""
        raise NotImplementedError

    @property
    def batched_reward(self) -> bool:
        """Whether the task scores a batch in one call (`score_batch`): a user's batched reward function."""
        return False

    def score_batch(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[Any]:
        """The rewards of a batch in one call, unchecked (`tasks.scoring.checked_batch` checks each); only for a
        task with `batched_reward`."""
        raise NotImplementedError

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"{problem.question} {ANSWER_FORMAT}"}]

    def data_read(self) -> str | None:
        """What the task read from the user's files, for `validate` to say ("20 rows of data.jsonl"); None for a
        task that generates its problems."""
        return None

    def tool_demonstration(self, problem: Problem, tools: frozenset[str]) -> list[dict[str, str]] | None:
        """A correct episode with the job's `tools` (assistant and tool messages, the last the answer) for the
        supervised warm-up of a tool-using job; None: the task has none for these tools (its plain
        demonstration is used)."""
        return None


TASKS: dict[str, Callable[[Any], Task]] = {}


TaskClass = TypeVar("TaskClass", bound=type[Task])


def register(name: str) -> Callable[[TaskClass], TaskClass]:
    def wrap(cls: TaskClass) -> TaskClass:
        cls.name = name
        TASKS[name] = cls
        return cls

    return wrap


def build_task(name: str, config: Any) -> Task:
    """The task registered as `name`; the error lists the valid names."""
    from tasks import arithmetic, countdown, dataset, gsm8k  # noqa: F401  (registers them)

    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; registered: {', '.join(sorted(TASKS))}")
    return TASKS[name](config)


def split_seed(seed: int, split: str) -> int:
    """A stream per split, so train, test and warm-up problems differ for the same job seed."""
    return seed * 1_000_003 + sum(ord(ch) * 31**i for i, ch in enumerate(split)) % 1_000_003


def jsonl_objects(path: Path, error: type[Exception] = TaskError) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank line of a JSONL file (gzip-compressed when its name ends in
    .gz). A line that is not a JSON object, or a file that cannot be read as text, raises `error` naming the
    file and line: no row is skipped silently."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else path.open(encoding="utf-8") as handle:
            for line_number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as problem:
                    raise error(f"{path}:{line_number}: not valid JSON ({problem.msg})") from None
                if not isinstance(row, dict):
                    raise error(f"{path}:{line_number}: a row must be a JSON object, got {type(row).__name__}")
                yield line_number, row
    except (OSError, EOFError, UnicodeDecodeError) as problem:  # EOFError: a gzip file cut short
        raise error(f"{path}: cannot be read ({problem})") from None


def read_jsonl(path: Path, max_rows: int | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """`jsonl_objects` of a task's data file (`task.path`), the first `max_rows` of them (None: all)."""
    if not path.is_file():
        raise TaskError(f"task.path: no data file at {path}")
    return itertools.islice(jsonl_objects(path), max_rows)


def file_problems(rows: Sequence[Problem], split: str, seed: int) -> Iterator[Problem]:
    """A data file's problems in a seeded order per split: training and the supervised warm-up cycle through
    reshuffled epochs (a small file lasts any number of steps); evaluation and the tokenizer corpus are one
    pass, each problem once."""
    order = list(range(len(rows)))
    rng = random.Random(split_seed(seed, split))
    for _ in itertools.count() if split in CYCLING_SPLITS else range(1):
        rng.shuffle(order)
        yield from (rows[i] for i in order)


def user_function(entry: str, field: str) -> Callable[..., Any]:
    """A user's function 'FILE.py:NAME' or 'module:NAME' (a reward, a tool), imported in this process; any error
    is a TaskError naming `field`."""
    source, _, name = entry.rpartition(":")
    try:
        module = _import_file(Path(source), field) if source.endswith(".py") else importlib.import_module(source)
    except TaskError:
        raise
    except Exception as error:
        raise TaskError(f"{field}: importing {source!r} failed: {type(error).__name__}: {error}") from error
    function = getattr(module, name, None)
    if not callable(function):
        raise TaskError(f"{field}: {source!r} has no function {name!r}")
    return function  # type: ignore[no-any-return]


def _import_file(path: Path, field: str) -> Any:
    path = path.expanduser().resolve()
    if not path.is_file():
        raise TaskError(f"{field}: no file {path}")
    name = "stableasync_user_" + re.sub(r"\W", "_", path.stem)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise TaskError(f"{field}: {path} cannot be imported")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look a class's module up here
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module

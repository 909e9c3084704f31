"""Repository contracts: CI runs the README's command, and the layout's import rules hold."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _readme_test_command() -> str:
    lines = (ROOT / "README.md").read_text().splitlines()
    block = lines[lines.index("```bash") + 1 : lines.index("```")]
    commands = [line for line in block if line and not line.startswith("#")]
    return commands[-1]


def test_ci_runs_the_readme_test_command():
    ci_lines = [
        line
        for line in (ROOT / ".ci/run").read_text().splitlines()
        if line and not line.startswith(("#", "set ", "cd "))
    ]
    assert ci_lines == [_readme_test_command()]


def _modules_after_import(module: str) -> set[str]:
    code = f"import sys, {module}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True)
    return {name.split(".")[0] for name in out.stdout.split()}


def test_algorithms_import_only_torch():
    loaded = _modules_after_import("algorithms.registry")
    forbidden = {"ray", "deepspeed", "vllm", "transformers", "cluster", "actors", "learner", "tasks", "wandb"}
    assert not loaded & forbidden


def test_stabilizer_configs_import_no_torch():
    assert "torch" not in _modules_after_import("algorithms.config")


def test_nothing_in_the_project_refers_to_files_outside_its_clone():
    """A user's clone has no `shared/` beside it, nor the developers' design notes: code, docs and config name
    only what the repository holds."""
    markers = ("../" + "shared", "DESIGN" + ".md", "redesign" + "-moves")  # in parts: this file must not match
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, check=True, capture_output=True, text=True).stdout.split()
    outside = [
        f"{name}: {marker}"
        for name in tracked
        if (ROOT / name).is_file() and (ROOT / name).stat().st_size < 1 << 20
        for marker in markers
        if marker in (ROOT / name).read_text(errors="ignore")
    ]
    assert not outside, f"these files refer to what a clone lacks: {outside}"


def _package_modules(package: str) -> list[str]:
    return sorted(f"{package}.{path.stem}" for path in (ROOT / package).glob("*.py") if path.stem != "__init__")


def test_the_lower_layers_never_import_cluster_or_ray():
    """actors, tasks and learner are plain classes and functions that cluster/ drives: none of their modules
    pulls in the orchestration layer or Ray."""
    for package in ("actors", "tasks", "learner"):
        loaded = _modules_after_import(", ".join(_package_modules(package)))
        assert not loaded & {"cluster", "ray"}, f"{package}: {sorted(loaded & {'cluster', 'ray'})}"


def test_every_error_the_project_defines_shares_one_base():
    """A caller tells StableAsync's explained failures from bugs by one class; the CLI prints those
    without a traceback."""
    code = """
import importlib, inspect, pkgutil
from algorithms.errors import StableAsyncError
stray = []
for package in ("algorithms", "actors", "tasks", "learner", "cluster"):
    for info in pkgutil.iter_modules([package]):
        module = importlib.import_module(f"{package}.{info.name}")
        for name, obj in vars(module).items():
            if (inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == module.__name__
                    and not issubclass(obj, StableAsyncError)):
                stray.append(f"{module.__name__}.{name}")
print(stray)
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


PROJECT_PACKAGES = ("algorithms", "actors", "benchmarks", "cluster", "learner", "tasks")


def _private_imports(source: str, module: str) -> list[str]:
    """`from X import _name` lines of `source` where X is another module than `module`."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module != module:
            found += [
                f"{node.lineno}: from {node.module} import {alias.name}"
                for alias in node.names
                if alias.name.startswith("_") and not alias.name.startswith("__")
            ]
    return found


def test_no_module_imports_another_modules_private_name():
    """A leading underscore says "this module's own": a name another module needs is made public instead."""
    assert _private_imports(
        "from tasks.countdown import _secret, evaluate\nfrom x import __version__\n", "tasks.tools"
    ) == ["1: from tasks.countdown import _secret"]  # the check can fail
    offenders = {}
    for package in PROJECT_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            if found := _private_imports(path.read_text(), module):
                offenders[str(path.relative_to(ROOT))] = found
    for path in sorted((ROOT / "tests").rglob("*.py")):  # a test checks a module through its public names
        found = [
            line
            for line in _private_imports(path.read_text(), "tests")
            if line.split(" import ")[0].split("from ")[1].split(".")[0] in PROJECT_PACKAGES
        ]
        if found:
            offenders[str(path.relative_to(ROOT))] = found
    assert not offenders, offenders


# What each lower layer may not import: its records are its own, and its consumers import them, not the reverse.
FORBIDDEN_IMPORTS = {
    "algorithms": {"tasks", "learner", "actors", "cluster"},
    "tasks": {"learner", "actors", "cluster"},
    "learner": {"tasks", "actors", "cluster"},
}


def _imported_packages(source: str) -> set[str]:
    """The top-level packages `source` imports, anywhere in it (inside functions too)."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
    return found


def test_no_layer_imports_upwards():
    """tasks/ and learner/ own the records they consume (tasks/records.py, learner/records.py); neither imports
    the layers that drive it."""
    assert _imported_packages("def f():\n    from actors.records import Completion\n") == {"actors"}
    offenders = {}
    for package, forbidden in FORBIDDEN_IMPORTS.items():
        for path in sorted((ROOT / package).rglob("*.py")):
            if bad := _imported_packages(path.read_text()) & forbidden:
                offenders[str(path.relative_to(ROOT))] = sorted(bad)
    assert not offenders, offenders


MAX_FUNCTION_LINES = 60
LONG_REASON = "# long: "


def unexplained_long_functions(source: str) -> list[str]:
    """The functions of `source` over MAX_FUNCTION_LINES lines (from `def` to their last line) without a
    `# long: REASON` comment on the line above their `def` or first decorator."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        assert node.end_lineno is not None
        if node.end_lineno - node.lineno + 1 <= MAX_FUNCTION_LINES:
            continue
        first = min([node.lineno, *(decorator.lineno for decorator in node.decorator_list)])
        above = lines[first - 2].strip() if first >= 2 else ""
        reason = above.removeprefix(LONG_REASON).strip() if above.startswith(LONG_REASON) else ""
        if len(reason.split()) < 3:  # a reason, not a word to silence the check
            found.append(f"{node.name} ({node.end_lineno - node.lineno + 1} lines, line {node.lineno})")
    return found


def test_a_function_over_60_lines_says_why_it_reads_better_whole():
    """A function that does not fit a screen costs its reader more than a long module does: split it where its
    concepts meet, or say on the line above it (`# long: REASON`) why it reads better whole (CONTRIBUTING.md)."""
    unexplained = {
        str(path.relative_to(ROOT)): found
        for package in PROJECT_PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if (found := unexplained_long_functions(path.read_text()))
    }
    assert not unexplained, f"functions over {MAX_FUNCTION_LINES} lines without a reason: {unexplained}"


def test_the_function_length_check_can_fail():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    assert unexplained_long_functions(f"def long():\n{body}") == [f"long ({MAX_FUNCTION_LINES + 1} lines, line 1)"]
    assert unexplained_long_functions(f"# long: {' '.join(['why'] * 3)}\ndef long():\n{body}") == []
    assert unexplained_long_functions(f"# long: why\n@staticmethod\ndef long():\n{body}") != []  # no reason
    short = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES - 1))
    assert unexplained_long_functions(f"def short():\n{short}") == []

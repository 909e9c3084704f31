"""ruff's rules (pyproject.toml: pycodestyle, pyflakes, import order, bugbear, pyupgrade, simplify, ruff's own) and
its formatter over the whole project, and mypy over every package: run here so that CI's one test command checks
them too."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *command], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_ruff_finds_nothing():
    result = _run("ruff", "check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_the_code_is_formatted():
    result = _run("ruff", "format", "--check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_mypy_finds_nothing_in_the_typed_parts():
    result = _run("mypy", "--cache-dir", "/tmp/stableasync-mypy-cache")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "no issues found" in result.stdout

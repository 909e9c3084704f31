"""The README and docs/ as a user reads them: every relative link lands on a file and a heading that exist, and
docs/jobs.md lists every field of the job schema with the default the schema gives it."""

from __future__ import annotations

import json
import re
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from cluster.job import Job

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]

# Fields documented on a page of their own, each held there by its own test: the stabilizers' settings
# (docs/stabilizers.md, tests/unit/algorithms/test_stabilizers.py), the alerts (docs/wandb.md,
# tests/unit/cluster/test_job.py), the sandbox (docs/security.md, tests/unit/tasks/test_sandbox.py); the items of
# scoring.rewards and eval.sets are described
# in docs/tasks.md. docs/jobs.md may give such a field a row; its default is checked then.
ELSEWHERE = {"algorithm.stabilizer", "logging.alerts", "sandbox", "scoring.rewards", "eval.sets"}
# Defaults of "" that no job can keep: `stableasync validate` refuses a gsm8k or dataset job without its file.
REQUIRED_BY_VALIDATE = {"task.path"}
ROW = re.compile(r"^\| `([a-z_]+(?:\.[a-z_]+)*)` \| ([^|]+) \|")


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation other than - and _ dropped, spaces
    turned into -, a repeated one numbered; headings inside fenced blocks are code, not headings."""
    anchors, seen, fenced = set(), {}, False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        heading = None if fenced else re.match(r"#{1,6} (.+)", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_every_relative_link_in_the_docs_resolves():
    """A link moved or renamed with its section breaks here, naming the page and the link."""
    broken = []
    for path in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists() or not dest.is_relative_to(ROOT):
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such file in the repository)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_link_check_can_fail(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n## Its section: `x.y`\n\n```python\n# not a heading\n```\n")
    assert _anchors(page) == {"a-page", "its-section-xy"}


def _sections(annotation: Any) -> list[type[BaseModel]]:
    """The section models a field holds: itself, its optional form, or a union's members (the tasks)."""
    return [
        member
        for member in (annotation, *typing.get_args(annotation))
        if isinstance(member, type) and issubclass(member, BaseModel)
    ]


SECTION = object()  # the default of a section: its rows are its fields


def _schema_fields(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, Any, bool]]:
    """(dotted path, default, whether docs/jobs.md must list it) of every field below `model`, through nested and
    optional sections and the fields of each task; a section's own path comes with the default SECTION."""
    for name, info in model.model_fields.items():
        path = prefix + (info.alias or name)
        sections = _sections(info.annotation)
        if path in ELSEWHERE or not sections:
            default = info.get_default(call_default_factory=True)
            yield path, SECTION if isinstance(default, BaseModel) else default, path not in ELSEWHERE
            continue
        yield path, SECTION, False
        for section in sections:
            yield from _schema_fields(section, path + ".")


def _documented_rows() -> dict[str, str]:
    rows: dict[str, str] = {}
    for line in (ROOT / "docs" / "jobs.md").read_text().splitlines():
        row = ROW.match(line)
        if row:
            assert row.group(1) not in rows, f"docs/jobs.md lists {row.group(1)} twice"
            rows[row.group(1)] = row.group(2).strip()
    return rows


def _written(default: Any, path: str) -> Any:
    """A schema default as a row writes it: "required", or the value as JSON has it (tuples as lists)."""
    if default is PydanticUndefined or (path in REQUIRED_BY_VALIDATE and default == ""):
        return "required"
    return json.loads(json.dumps(default))


def test_docs_jobs_lists_every_field_with_its_default():
    """Each row of docs/jobs.md's tables gives a field's dotted path and its default as YAML, each in backticks,
    or `required`: a field added to the schema without a row, a row for a field that is gone, or a default
    changed on one side only fails here."""
    rows = _documented_rows()
    assert len(rows) >= 100, "the tables of docs/jobs.md were not read"
    fields = list(_schema_fields(Job))
    must_list = {path for path, _, listed in fields if listed}
    assert not must_list - set(rows), f"docs/jobs.md has no row for {sorted(must_list - set(rows))}"
    unknown = set(rows) - {path for path, _, _ in fields}
    assert not unknown, f"docs/jobs.md has rows for fields the schema lacks: {sorted(unknown)}"
    wrong = []
    for path, cell in rows.items():
        expected = [_written(default, path) for field, default, _ in fields if field == path and default is not SECTION]
        if not expected:  # a section's row: its fields have theirs
            continue
        assert all(value == expected[0] for value in expected), f"{path}: the tasks that have it differ in default"
        written = cell if cell == "required" else yaml.safe_load(cell.strip("`"))
        if written != expected[0]:
            wrong.append(f"{path}: docs/jobs.md says {cell}, the schema {expected[0]!r}")
    assert not wrong, "\n".join(wrong)

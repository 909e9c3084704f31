"""`stableasync wandb-workspace`: the W&B workspace of deploy/wandb/workspace.yaml, built with the
`wandb-workspaces` library, so the dashboard people look at is the file the tests check, not a copy made by hand.

Offline (no W&B login, or WANDB_MODE=offline) it writes the view it would save, as the library serialises it;
online it saves the view to the project and prints its URL.
"""

from __future__ import annotations

import json
import netrc
import os
import sys
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from algorithms.errors import StableAsyncError

# What the file may hold. tests/unit/cluster/test_metrics.py checks the file against the same panel fields, so a field
# this module would have to drop (and a panel that would silently differ from the file) fails a test first.
WORKSPACE_FIELDS = frozenset({"name", "x_axis", "sections"})
SECTION_FIELDS = frozenset({"name", "panels"})
PANEL_FIELDS = frozenset({"kind", "title", "y", "log_y", "range_y"})
# wandb-workspaces has no histogram panel: W&B draws a key logged as a histogram every step, in a line plot,
# as a heatmap of its bins over steps, so both kinds become line plots.
KINDS = ("line", "histogram")
OFFLINE_MODES = ("offline", "dryrun", "disabled")


class WorkspaceSpecError(StableAsyncError, ValueError):
    """The workspace file holds something the library cannot express; the message names the section and panel."""


# the repository's own file, wherever the command runs from
DEFAULT_SPEC = Path(__file__).resolve().parents[2] / "deploy" / "wandb" / "workspace.yaml"
# offline without --entity/--project: the view names these, to be replaced when it is saved
PLACEHOLDER_ENTITY, PLACEHOLDER_PROJECT = "ENTITY", "PROJECT"


def load_spec(path: str | Path) -> dict[str, Any]:
    """The workspace file as data, or a WorkspaceSpecError (the caller names the file)."""
    try:
        spec = yaml.safe_load(Path(path).read_text())
    except OSError as error:
        raise WorkspaceSpecError(f"cannot be read ({error.strerror}); --spec FILE takes another file") from None
    except yaml.YAMLError as error:
        raise WorkspaceSpecError(f"is not YAML: {error}") from None
    if not isinstance(spec, dict):
        raise WorkspaceSpecError("not a mapping with name, x_axis and sections")
    return spec


def _unknown(where: str, fields: Any, allowed: frozenset[str]) -> None:
    extra = sorted(set(fields) - allowed)
    if extra:
        raise WorkspaceSpecError(
            f"{where}: {', '.join(map(repr, extra))} cannot be expressed in the workspace "
            f"(allowed: {', '.join(sorted(allowed))})"
        )


def _library() -> tuple[Any, Any]:
    """wandb_workspaces' report panels and workspaces, imported quietly: the library still declares pydantic v1
    style validators, and their deprecation warnings say nothing to a user of this command."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import wandb_workspaces.reports.v2 as wr
        import wandb_workspaces.workspaces as ws
    return wr, ws


def _panel(where: str, panel: Any, x_axis: str) -> Any:
    """One panel as a wandb-workspaces line plot against the workspace's x-axis."""
    import pydantic

    wr, _ = _library()

    if not isinstance(panel, dict):
        raise WorkspaceSpecError(f"{where}: a panel is a mapping, not {panel!r}")
    _unknown(where, panel, PANEL_FIELDS)
    if panel.get("kind") not in KINDS:
        raise WorkspaceSpecError(f"{where}: kind {panel.get('kind')!r} is not one of {', '.join(KINDS)}")
    y = panel.get("y")
    if not isinstance(y, list) or not y or not all(isinstance(key, str) for key in y):
        raise WorkspaceSpecError(f"{where}: y must be a non-empty list of metric keys, not {y!r}")
    range_y = panel.get("range_y", [None, None])
    if not isinstance(range_y, list) or len(range_y) != 2:
        raise WorkspaceSpecError(f"{where}: range_y must be [low, high], not {range_y!r}")
    try:
        return wr.LinePlot(title=panel.get("title"), x=x_axis, y=y, log_y=panel.get("log_y"), range_y=tuple(range_y))
    except pydantic.ValidationError as error:  # a value of the wrong type: the field and the library's reason
        reasons = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
        raise WorkspaceSpecError(f"{where}: {reasons}") from None


def build_workspace(spec: dict[str, Any], entity: str, project: str) -> Any:
    """The wandb_workspaces Workspace of a workspace file: one open section per file section, in its order."""
    _, ws = _library()
    _unknown("the workspace", spec, WORKSPACE_FIELDS)
    x_axis = spec.get("x_axis")
    if not isinstance(x_axis, str):
        raise WorkspaceSpecError(f"x_axis must be a metric key, not {x_axis!r}")
    sections = []
    for number, section in enumerate(spec.get("sections") or [], start=1):
        name = section.get("name") if isinstance(section, dict) else None
        if not isinstance(name, str):
            raise WorkspaceSpecError(f"section {number}: needs a name")
        _unknown(f"section {name!r}", section, SECTION_FIELDS)
        panels = [
            _panel(f"section {name!r}, panel {index} ({p.get('title') if isinstance(p, dict) else p!r})", p, x_axis)
            for index, p in enumerate(section.get("panels") or [], start=1)
        ]
        sections.append(ws.Section(name=name, panels=panels, is_open=True))
    if not sections:
        raise WorkspaceSpecError("the workspace has no sections")
    return ws.Workspace(
        entity=entity,
        project=project,
        name=str(spec.get("name", "StableAsync")),
        settings=ws.WorkspaceSettings(x_axis=x_axis),
        sections=sections,
    )


def saved_view(workspace: Any) -> dict[str, Any]:
    """What `workspace.save()` sends to W&B (the view's fields and its spec, serialised as the library does for
    the upsert), so the offline file is the dashboard, not a description of it."""
    view = workspace._to_model()  # the library's own conversion; save() calls the same
    return {
        "entityName": view.entity,
        "projectName": view.project,
        "displayName": view.display_name,
        "type": "project-view",
        "spec": json.loads(view.spec.model_dump_json(by_alias=True, exclude_none=True)),
    }


def default_offline() -> bool:
    """Offline unless W&B could be reached with a key: WANDB_MODE says offline, or no key in the environment
    or in the netrc file `wandb login` writes."""
    if os.environ.get("WANDB_MODE", "").lower() in OFFLINE_MODES:
        return True
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return False
    host = urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or ""
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is None
    except (OSError, netrc.NetrcParseError):
        return True


def run_cli(spec_path: str | None, entity: str | None, project: str | None, offline: bool, out: str | None) -> int:
    """`stableasync wandb-workspace`: exit 2 naming what in the file cannot be built, 1 when saving fails."""
    offline = offline or default_offline()
    if not offline and not (entity and project):
        print(
            "stableasync wandb-workspace: saving to W&B needs --entity and --project (the jobs' "
            "logging.wandb.entity and .project); --offline writes the view without them",
            file=sys.stderr,
        )
        return 2
    spec_file = Path(spec_path) if spec_path else DEFAULT_SPEC
    try:
        workspace = build_workspace(load_spec(spec_file), entity or PLACEHOLDER_ENTITY, project or PLACEHOLDER_PROJECT)
    except WorkspaceSpecError as error:
        print(f"stableasync wandb-workspace: {spec_file}: {error}", file=sys.stderr)
        return 2
    if offline or out:
        path = Path(out or "runs/wandb-workspace.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(saved_view(workspace), indent=1) + "\n")
        print(
            f"workspace {workspace.name!r} for {workspace.entity}/{workspace.project}: {len(workspace.sections)} "
            f"sections, {sum(len(s.panels) for s in workspace.sections)} panels; the view it would save: {path}"
        )
    if offline:
        print(
            "to save it, run the same command where W&B is reachable and logged in (`wandb login`), with "
            "--entity and --project: the view is built from the workspace file again, not from this JSON"
        )
        return 0
    try:
        workspace.save()
    except Exception as error:
        print(
            f"stableasync wandb-workspace: saving to {entity}/{project} failed: {type(error).__name__}: {error}",
            file=sys.stderr,
        )
        return 1
    print(f"saved workspace {workspace.name!r}: {workspace.url}")
    return 0

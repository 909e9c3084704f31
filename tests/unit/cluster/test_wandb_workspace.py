"""`stableasync wandb-workspace`: the W&B view built from deploy/wandb/workspace.yaml by wandb-workspaces holds
every section, panel, metric key, axis and scale of the file, and what the file cannot express is refused."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
WORKSPACE = ROOT / "deploy" / "wandb" / "workspace.yaml"


def _file() -> dict:
    return yaml.safe_load(WORKSPACE.read_text())


def _written_sections(view: dict) -> list[dict]:
    return view["spec"]["section"]["panelBankConfig"]["sections"]


def _check_view_matches_file(view: dict, spec: dict) -> None:
    """Section by section and panel by panel, in order: the file's names, titles, keys, axis, scale and range."""
    assert view["displayName"] == spec["name"]
    assert view["spec"]["section"]["settings"]["xAxis"] == spec["x_axis"] == "train/step"
    sections = _written_sections(view)
    assert [s["name"] for s in sections] == [s["name"] for s in spec["sections"]]
    for written, wanted in zip(sections, spec["sections"]):
        assert len(written["panels"]) == len(wanted["panels"]), written["name"]
        for panel, p in zip(written["panels"], wanted["panels"]):
            config = panel["config"]
            where = f"{wanted['name']} / {p['title']}"
            assert panel["viewType"] == "Run History Line Plot", where
            assert config["chartTitle"] == p["title"], where
            assert config["metrics"] == p["y"], where
            assert config["xAxis"] == spec["x_axis"], where
            assert config.get("yLogScale", False) == p.get("log_y", False), where
            low, high = p.get("range_y", (None, None))
            assert (config.get("yAxisMin"), config.get("yAxisMax")) == (low, high), where


def test_the_view_of_the_real_workspace_file_has_every_section_panel_key_and_scale(tmp_path):
    from cluster.telemetry.workspace import build_workspace, saved_view

    spec = _file()
    view = saved_view(build_workspace(spec, "my-team", "stableasync"))
    assert (view["entityName"], view["projectName"]) == ("my-team", "stableasync")
    _check_view_matches_file(view, spec)
    plotted = {key for s in _written_sections(view) for panel in s["panels"] for key in panel["config"]["metrics"]}
    assert plotted == {key for s in spec["sections"] for p in s["panels"] for key in p["y"]}
    assert any(p.get("log_y") for s in spec["sections"] for p in s["panels"]), "the file has log-scale panels"


def test_the_check_itself_catches_a_view_that_differs_from_the_file():
    """The comparison above can fail: a view built from a changed file does not match the real one."""
    from cluster.telemetry.workspace import build_workspace, saved_view

    spec = _file()
    for change in ("log_y", "key", "section"):
        other = copy.deepcopy(spec)
        panel = other["sections"][0]["panels"][0]
        if change == "log_y":
            panel["log_y"] = not panel.get("log_y", False)
        elif change == "key":
            panel["y"] = [*panel["y"], "optim/loss"]
        else:
            other["sections"].pop()
        with pytest.raises(AssertionError):
            _check_view_matches_file(saved_view(build_workspace(other, "e", "p")), spec)


def test_the_builder_expresses_exactly_the_panel_fields_the_file_is_checked_against():
    from cluster.telemetry.workspace import PANEL_FIELDS
    from tests.unit.cluster import test_metrics

    assert PANEL_FIELDS == test_metrics.PANEL_FIELDS


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"kind": "bar"},
            r"section 'Optimization', panel 2 \('Policy loss'\): kind 'bar' is not one of line, histogram",
        ),
        ({"smoothing": 0.5}, r"section 'Optimization', panel 2 \('Policy loss'\): 'smoothing' cannot be expressed"),
        ({"y": []}, r"section 'Optimization', panel 2 \('Policy loss'\): y must be a non-empty list"),
        ({"range_y": [0]}, r"section 'Optimization', panel 2 \('Policy loss'\): range_y must be \[low, high\]"),
        (
            {"log_y": "very"},
            r"section 'Optimization', panel 2 \('Policy loss'\): log_y: Input should be a valid boolean",
        ),
    ],
)
def test_a_panel_the_library_cannot_express_is_refused_naming_its_section_and_panel(change, message):
    from cluster.telemetry.workspace import WorkspaceSpecError, build_workspace

    spec = _file()
    panel = spec["sections"][1]["panels"][1]
    assert panel["title"] == "Policy loss"
    panel.update(change)
    with pytest.raises(WorkspaceSpecError, match=message):
        build_workspace(spec, "e", "p")


def test_the_command_writes_the_view_offline_and_a_bad_file_exits_2(tmp_path):
    out = tmp_path / "view.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "cluster.cli",
            "wandb-workspace",
            "--entity",
            "my-team",
            "--project",
            "stableasync",
            "--offline",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert str(out) in result.stdout and f"{len(_file()['sections'])} sections" in result.stdout
    _check_view_matches_file(json.loads(out.read_text()), _file())

    bad = _file()
    bad["sections"][4]["panels"][0]["kind"] = "heatmap"
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    from cluster.cli import main

    assert (
        main(
            [
                "wandb-workspace",
                "--spec",
                str(tmp_path / "bad.yaml"),
                "--entity",
                "e",
                "--project",
                "p",
                "--offline",
                "--out",
                str(tmp_path / "bad.json"),
            ]
        )
        == 2
    )
    assert not (tmp_path / "bad.json").exists()


def _no_wandb_login(monkeypatch, tmp_path):
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))


def test_offline_is_the_default_without_a_key_or_with_wandb_mode_offline(tmp_path, monkeypatch):
    from cluster.telemetry.workspace import default_offline

    _no_wandb_login(monkeypatch, tmp_path)
    assert default_offline()
    (tmp_path / "no-netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    assert not default_offline(), "a `wandb login` key in the netrc file"
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert default_offline()
    monkeypatch.delenv("WANDB_MODE")
    (tmp_path / "no-netrc").unlink()
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert not default_offline()


def test_online_saves_the_workspace_and_prints_its_url(tmp_path, monkeypatch, capsys):
    """Without network: the library's save is replaced, and it must be called with the built workspace."""
    import wandb_workspaces.workspaces as ws

    from cluster.cli import main

    _no_wandb_login(monkeypatch, tmp_path)
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    saved = []
    monkeypatch.setattr(ws.Workspace, "save", lambda self: saved.append(self) or self)
    monkeypatch.setattr(ws.Workspace, "url", property(lambda self: f"https://wandb.ai/{self.entity}/{self.project}"))
    monkeypatch.chdir(tmp_path)
    assert main(["wandb-workspace", "--spec", str(WORKSPACE), "--entity", "my-team", "--project", "sa"]) == 0
    assert [w.name for w in saved] == [_file()["name"]]
    assert [s.name for s in saved[0].sections] == [s["name"] for s in _file()["sections"]]
    assert "https://wandb.ai/my-team/sa" in capsys.readouterr().out
    assert not (tmp_path / "runs").exists(), "online without --out writes nothing"

    def unreachable(self):
        raise ConnectionError("api.wandb.ai unreachable")

    monkeypatch.setattr(ws.Workspace, "save", unreachable)
    assert main(["wandb-workspace", "--spec", str(WORKSPACE), "--entity", "my-team", "--project", "sa"]) == 1
    assert "ConnectionError: api.wandb.ai unreachable" in capsys.readouterr().err


def test_offline_from_any_directory_needs_no_entity_project_or_spec_and_says_how_to_save(tmp_path, capsys):
    """It required --entity and --project even offline, and found its file only from the repository root."""
    import os

    from cluster.cli import main

    here = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert main(["wandb-workspace", "--offline"]) == 0
        out = capsys.readouterr().out
        assert "for ENTITY/PROJECT" in out and "run the same command where W&B is reachable" in out
        _check_view_matches_file(json.loads((tmp_path / "runs" / "wandb-workspace.json").read_text()), _file())
        assert main(["wandb-workspace", "--offline", "--spec", "missing.yaml"]) == 2
        err = capsys.readouterr().err
        assert err.count("missing.yaml") == 1 and "--spec FILE takes another file" in err
    finally:
        os.chdir(here)


def test_saving_without_entity_or_project_says_which_flags_it_needs(tmp_path, monkeypatch, capsys):
    from cluster.cli import main

    _no_wandb_login(monkeypatch, tmp_path)
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert main(["wandb-workspace", "--entity", "my-team"]) == 2
    assert "needs --entity and --project" in capsys.readouterr().err


def test_the_docs_name_every_section_of_the_workspace_file():
    text = " ".join((ROOT / "docs" / "wandb.md").read_text().split())
    sections = [section["name"] for section in _file()["sections"]]
    numbers = {6: "six", 7: "seven", 8: "eight", 9: "nine"}
    assert f"{numbers[len(sections)]} sections ({', '.join(sections)};" in text

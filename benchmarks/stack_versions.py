"""The versions a GPU run measured with, beside the `gpu` extra's pins: every GPU table names them, since the lent
machine's PyTorch may not be the one users install (`deploy/gpu-bench.sh` prints this first).

`python -m benchmarks.stack_versions` prints one line per package and, where a version differs from its pin,
says so; it never fails for a difference (a lent machine has what it has), only for a package it cannot import.
"""

from __future__ import annotations

import importlib
import re
import sys
import tomllib
from pathlib import Path

PACKAGES = ("torch", "transformers", "deepspeed", "peft")
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def gpu_pins(pyproject: Path = PYPROJECT) -> dict[str, str]:
    """Package name -> the exact version the `gpu` extra pins (`name==version` entries only)."""
    extra = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]["gpu"]
    pins = {}
    for requirement in extra:
        if match := re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==([^;\s]+)", requirement.strip()):
            pins[match[1].lower()] = match[2]
    return pins


def version_lines(installed: dict[str, str], pins: dict[str, str]) -> list[str]:
    """One line per package: its version, its pin, and whether they differ (a local tag like +cu130 aside)."""
    lines = []
    for name, version in installed.items():
        pin = pins.get(name)
        differs = pin is not None and version.split("+")[0] != pin.split("+")[0]
        lines.append(f"{name} {version} (gpu extra pins {pin or 'nothing'}{'; DIFFERS' if differs else ''})")
    return lines


def main() -> int:
    installed = {}
    for name in PACKAGES:
        installed[name] = importlib.import_module(name).__version__
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    print(f"{device}; CUDA {torch.version.cuda}; Python {sys.version.split()[0]}")
    print("\n".join(version_lines(installed, gpu_pins())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

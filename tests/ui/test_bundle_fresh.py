"""The frontend shipped in the package (src/refractor/ui/static/) is exactly what its source in
frontend/ builds to, so a machine without Node.js serves the current dashboard."""

from __future__ import annotations

import filecmp
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FRONTEND = ROOT / "frontend"
SHIPPED = ROOT / "src" / "refractor" / "ui" / "static"


def files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def test_the_shipped_bundle_is_built_from_the_current_source(tmp_path):
    if shutil.which("node") is None:
        pytest.skip("no Node.js to rebuild the frontend with")
    if not (FRONTEND / "node_modules").is_dir():
        pytest.skip(
            "frontend/node_modules is absent: run `npm ci` in frontend/ (scripts/install.sh --dev does)"
        )
    out = tmp_path / "static"
    proc = subprocess.run(
        ["node", "build.mjs", str(out)], cwd=FRONTEND, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert files(out) == files(SHIPPED)
    stale = [f for f in files(out) if not filecmp.cmp(out / f, SHIPPED / f, shallow=False)]
    assert not stale, f"rebuild the frontend (cd frontend && npm run build): {stale} differ"

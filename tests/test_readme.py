"""The README is the front door: its test command is exactly what CI runs."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _fenced_commands(text: str) -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    return [line.split("#")[0].strip() for b in blocks for line in b.splitlines() if line.strip()]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    tests_section = readme.split("## Tests", 1)[1]
    command = _fenced_commands(tests_section)[0]
    ci_lines = [
        ln.strip()
        for ln in (ROOT / ".ci" / "run").read_text().splitlines()
        if ln.strip() and not ln.strip().startswith("#")
    ]
    assert ci_lines[-1] == command


def test_readme_setup_command_is_what_ci_installs_with():
    readme = (ROOT / "README.md").read_text()
    setup = _fenced_commands(readme.split("## Quick start", 1)[1])[0]
    assert setup.startswith("bash scripts/install.sh")
    assert "bash scripts/install.sh" in (ROOT / ".ci" / "run").read_text()


def _ruff(*args: str) -> subprocess.CompletedProcess:
    beside = Path(sys.executable).with_name("ruff")  # the virtual environment's, active or not
    ruff = str(beside) if beside.is_file() else shutil.which("ruff")
    assert ruff, "ruff is part of the dev extra"
    paths = [
        p for p in ("src", "tests", "bench", "environments", "train.py", "eval.py") if (ROOT / p).exists()
    ]
    return subprocess.run([ruff, *args, *paths], cwd=ROOT, capture_output=True, text=True)


def test_lint_is_clean():
    proc = _ruff("check")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_code_is_formatted():
    proc = _ruff("format", "--check")
    assert proc.returncode == 0, "run `ruff format`:\n" + proc.stdout + proc.stderr

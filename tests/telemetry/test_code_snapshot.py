"""The code snapshot of a run: what it takes from a real git repository and from a plain folder, its
counts, the git state, the round trip through the run store, and the diff of two runs' code."""

from __future__ import annotations

import hashlib
import sqlite3
import subprocess
from pathlib import Path

import pytest

from refractor.config import RefractorConfig
from refractor.telemetry.code_snapshot import (
    PROJECT_ROOT,
    CodeLimits,
    excluded_prefix,
    record_code_snapshot,
    take_code_snapshot,
)
from refractor.telemetry.query import RunReader, diff_code
from refractor.telemetry.store import SCHEMA_VERSION, RunStore
from refractor.train import user_code_folders

LIMITS = CodeLimits(max_file_bytes=1000, exclude_patterns=("__pycache__", "*.pyc", "data", ".git"))


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def write(path: Path, content: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


def make_repo(root: Path) -> Path:
    """A repository with one commit, then: a modified file, a deleted one, an untracked one, an
    ignored one, a too-large one, a binary one, and files under excluded patterns (one tracked)."""
    root.mkdir()
    git(root, "init", "-q", "-b", "main")
    git(root, "config", "user.email", "t@example.com")
    git(root, "config", "user.name", "t")
    write(root / ".gitignore", "*.log\n")
    write(root / "configs" / "train.yaml", "learning_rate: 1e-6\n")
    write(root / "src" / "env.py", "def reward():\n    return 0\n")
    write(root / "old.py", "print('old')\n")
    write(root / "data" / "train.jsonl", '{"q": 1}\n')
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "first")
    write(root / "src" / "env.py", "def reward():\n    return 1\n")
    (root / "old.py").unlink()
    write(root / "data" / "train.jsonl", '{"q": 2}\n')
    write(root / "new_tool.py", "print('new')")
    write(root / "run.log", "ignored\n")
    write(root / "big.txt", "x" * 2000)
    write(root / "weights.bin", b"\x00\x01\x02")
    write(root / "src" / "__pycache__" / "env.cpython-311.pyc", b"cached")
    return root


def test_a_git_project_holds_its_tracked_and_untracked_files_and_its_diff(tmp_path):
    repo = make_repo(tmp_path / "repo")
    snapshot = take_code_snapshot(repo / "configs", {}, LIMITS)  # the config's folder widens to the repo
    files = {f.path: content for f, content in snapshot.files}
    assert sorted(files) == [".gitignore", "configs/train.yaml", "new_tool.py", "src/env.py"]
    assert files["src/env.py"] == b"def reward():\n    return 1\n"
    assert {f.root for f, _ in snapshot.files} == {PROJECT_ROOT}
    info = snapshot.info
    assert (info.file_count, info.total_bytes) == (4, sum(map(len, files.values())))
    assert (info.skipped_too_large, info.skipped_binary, info.skipped_excluded) == (
        1,
        1,
        2,
    )  # data/, __pycache__/
    assert (info.skipped_over_limit, info.skipped_unreadable) == (0, 0)
    assert snapshot.warnings == []
    [root] = info.roots
    assert root.folder == str(repo.resolve())
    state = root.git
    assert state is not None
    assert (state.commit, state.branch, state.dirty) == (git(repo, "rev-parse", "HEAD").strip(), "main", True)
    assert "-    return 0\n+    return 1\n" in state.diff
    assert "diff --git a/old.py b/old.py\ndeleted file mode 100644" in state.diff
    assert "--- /dev/null\n+++ b/new_tool.py\n@@ -0,0 +1 @@\n+print('new')\n\\ No newline" in state.diff
    for left_out in ("data/train.jsonl", "run.log", "big.txt", "weights.bin", "__pycache__"):
        assert left_out not in state.diff
    assert not state.diff_truncated


def test_a_clean_checkout_is_not_dirty_and_has_no_diff(tmp_path):
    repo = make_repo(tmp_path / "repo")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "second")
    git(repo, "checkout", "-q", "--detach")
    state = take_code_snapshot(repo, {}, LIMITS).info.roots[0].git
    assert state is not None
    assert (state.branch, state.dirty, state.diff) == ("", False, "")


def test_a_plain_folder_is_walked_and_user_folders_outside_it_get_their_own_root(tmp_path):
    project = tmp_path / "project"
    write(project / "train.yaml", "number_of_steps: 3\n")
    write(project / "envs" / "inside" / "environment.py", "A = 1\n")
    write(project / "__pycache__" / "x.pyc", b"c")
    write(project / "notes" / "data" / "rows.json", "[]")
    write(project / "weights.bin", b"ab\x00cd")
    write(project / "big.txt", "y" * 1001)
    write(project / "runs" / "t" / "config.yaml", "run: t\n")
    (project / "loop").symlink_to("loop")  # reading it fails: a warning, not an error
    outside = write(tmp_path / "elsewhere" / "mine" / "environment.py", "B = 2\n").parent
    snapshot = take_code_snapshot(
        project,
        {"env:inside": project / "envs" / "inside", "env:mine": outside},
        LIMITS,
        skip=[project / "runs"],
    )
    assert [(f.root, f.path) for f, _ in snapshot.files] == [
        ("env:mine", "environment.py"),
        (PROJECT_ROOT, "envs/inside/environment.py"),
        (PROJECT_ROOT, "train.yaml"),
    ]
    assert [(r.label, r.folder, r.git) for r in snapshot.info.roots] == [
        (PROJECT_ROOT, str(project), None),
        ("env:mine", str(outside), None),
    ]
    info = snapshot.info
    assert (info.skipped_too_large, info.skipped_binary, info.skipped_excluded) == (1, 1, 2)
    assert info.skipped_unreadable == 1 and len(snapshot.warnings) == 1 and "loop" in snapshot.warnings[0]


def test_the_caps_on_the_whole_snapshot_and_on_the_diff_leave_files_out_and_count_them(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    for i in range(5):
        write(repo / f"f{i}.txt", f"line {i}\n" * 4)  # 28 bytes each, all untracked
    few = CodeLimits(1000, max_files=3, max_diff_bytes=100)
    snapshot = take_code_snapshot(repo, {}, few)
    assert [f.path for f, _ in snapshot.files] == ["f0.txt", "f1.txt", "f2.txt"]
    assert (snapshot.info.file_count, snapshot.info.skipped_over_limit) == (3, 2)
    state = snapshot.info.roots[0].git
    assert state is not None and state.commit == ""  # no commit yet: every file is shown as added
    assert state.diff_truncated and len(state.diff.encode()) <= 100 and state.diff.startswith("diff --git")
    small = take_code_snapshot(repo, {}, CodeLimits(1000, max_total_bytes=60))
    assert (small.info.file_count, small.info.total_bytes, small.info.skipped_over_limit) == (2, 56, 3)


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("src/__pycache__/a.pyc", "src/__pycache__"),
        ("a/b/c.pyc", "a/b/c.pyc"),
        ("docs/img.png", "docs/img.png"),
        ("src/docs/img.png", None),
        ("my_data/x", None),
        (".env.local", ".env.local"),
    ],
)
def test_an_exclude_pattern_matches_a_path_component_or_the_leading_path(path, expected):
    assert excluded_prefix(path, ["__pycache__", "*.pyc", "docs/*.png", ".env*", "data"]) == expected


def test_the_snapshot_round_trips_through_the_run_store_and_a_later_one_replaces_it(tmp_path):
    repo = make_repo(tmp_path / "repo")
    store = RunStore(tmp_path / "run")
    earlier = write(tmp_path / "earlier" / "old_code.py", "a = 0\n").parent
    store.log_code_snapshot(take_code_snapshot(earlier, {}, LIMITS))
    snapshot = take_code_snapshot(repo, {}, LIMITS)
    store.log_code_snapshot(snapshot)
    store.close()
    with RunReader(tmp_path / "run") as reader:
        assert reader.code_info() == snapshot.info
        stored = reader.code_files()
        assert stored == [f for f, _ in snapshot.files]
        for f in stored:
            on_disk = (repo / f.path).read_bytes()
            assert reader.code_file(f.root, f.path) == on_disk.decode()
            assert (f.size, f.sha256) == (len(on_disk), hashlib.sha256(on_disk).hexdigest())
        assert reader.code_file(PROJECT_ROOT, "weights.bin") is None
        assert reader.meta()["schema_version"] == SCHEMA_VERSION >= 3


def test_a_failed_snapshot_is_a_warning_event_and_the_run_store_goes_on(tmp_path):
    project = tmp_path / "project"
    write(project / "train.yaml", "a: 1\n")
    for i in range(25):  # reading each fails: one warning each, 20 events at most
        (project / f"loop{i:02d}").symlink_to(f"loop{i:02d}")
    store = RunStore(tmp_path / "run")

    def no_folders():
        raise RuntimeError("registry broken")

    record_code_snapshot(store, project, dict, LIMITS, [])
    record_code_snapshot(store, project, no_folders, LIMITS, [])
    store.log_step_metrics(0, {"loss": 1.0})
    store.close()
    with RunReader(tmp_path / "run") as reader:
        messages = [e["attrs"]["message"] for e in reader.timeline() if e["name"] == "code_snapshot_warning"]
        assert len(messages) == 21
        assert all("loop" in m for m in messages[:19])
        assert messages[19:] == [
            "code snapshot: 6 more warnings not shown",
            "code snapshot failed: RuntimeError: registry broken",
        ]
        assert [f.path for f in reader.code_files()] == ["train.yaml"]  # the first snapshot stays
        assert reader.step_metrics() == [{"step": 0, "loss": 1.0}]


def store_snapshot(run: Path, project: Path) -> RunReader:
    store = RunStore(run)
    store.log_code_snapshot(take_code_snapshot(project, {}, LIMITS))
    store.close()
    return RunReader(run)


def test_two_runs_code_differs_by_added_removed_and_changed_files(tmp_path):
    project = tmp_path / "project"
    write(project / "train.py", "lr = 1\nsteps = 3\n")
    write(project / "gone.py", "x = 1\n")
    write(project / "same.py", "y = 2\n")
    first = store_snapshot(tmp_path / "a", project)
    write(project / "train.py", "lr = 2\nsteps = 3\n")
    (project / "gone.py").unlink()
    write(project / "new.py", "z = 3\n")
    second = store_snapshot(tmp_path / "b", project)
    with first, second:
        diff = diff_code(first, second)
        assert [(c.root, c.path) for c in diff.added] == [(PROJECT_ROOT, "new.py")]
        assert [(c.root, c.path) for c in diff.removed] == [(PROJECT_ROOT, "gone.py")]
        [changed] = diff.changed
        assert changed.path == "train.py"
        assert changed.diff == (
            "--- a/project/train.py\n+++ b/project/train.py\n@@ -1,2 +1,2 @@\n-lr = 1\n+lr = 2\n steps = 3\n"
        )
        assert diff.added[0].diff.endswith("+z = 3\n") and diff.removed[0].diff.endswith("-x = 1\n")
        assert diff_code(second, second).same and not diff.same


VERSION_2_STORE = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
INSERT INTO meta VALUES ('schema_version', '2'), ('status', '"finished"');
CREATE TABLE system_metrics (
    time REAL NOT NULL, source TEXT NOT NULL, name TEXT NOT NULL, value REAL, node TEXT NOT NULL DEFAULT '');
"""


def test_a_version_2_store_has_no_code_and_gets_the_tables_when_written_again(tmp_path):
    conn = sqlite3.connect(tmp_path / "run.db")
    conn.executescript(VERSION_2_STORE)
    conn.close()
    with RunReader(tmp_path) as reader:
        assert (reader.code_info(), reader.code_files(), reader.code_file(PROJECT_ROOT, "a.py")) == (
            None,
            [],
            None,
        )
        assert diff_code(reader, reader).same
    project = write(tmp_path / "project" / "a.py", "a = 1\n").parent
    store = RunStore(tmp_path)  # a resume: the new tables are created, the snapshot stored
    store.log_code_snapshot(take_code_snapshot(project, {}, LIMITS))
    store.close()
    with RunReader(tmp_path) as reader:
        assert reader.code_file(PROJECT_ROOT, "a.py") == "a = 1\n"
        assert reader.meta()["schema_version"] == SCHEMA_VERSION


def test_the_user_folders_of_a_run_are_its_environments_and_evals_from_folders(tmp_path, monkeypatch):
    write(tmp_path / "envs" / "mine" / "environment.py", "A = 1\n")
    write(tmp_path / "evals" / "myeval" / "eval.py", "B = 1\n")
    monkeypatch.setenv("REFRACTOR_ENV_PATH", str(tmp_path / "envs"))
    monkeypatch.setenv("REFRACTOR_EVAL_PATH", str(tmp_path / "evals"))
    monkeypatch.chdir(tmp_path)
    cfg = RefractorConfig(
        model="some/model",
        environments=[{"name": "mine"}, {"name": "countdown"}],  # countdown: a built-in, not user code
        evals=[{"name": "myeval"}, {"name": "mine"}, {"name": "math500"}],
    )
    assert user_code_folders(cfg) == {
        "eval:myeval": tmp_path / "evals" / "myeval",
        "env:mine": tmp_path / "envs" / "mine",
    }

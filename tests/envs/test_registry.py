"""Discovery: a Telescope-style user environment in a folder, entry points, and clear errors."""

import asyncio
import sys
import textwrap

import pytest
from typer.testing import CliRunner

from refractor.envs import get_environment, score_rollout
from refractor.envs.registry import ENV_PATH_VAR, discover, load_environment_class
from refractor.envs.testing import finished_state

# Written only against the documented API, the way a Telescope user writes an environment
# (imports differ from Telescope by the package prefix only).
USER_ENV = """
from refractor.envs.base import SingleTurnEnvironment, Sample, RewardResult
from refractor.envs.parsers import extract_answer_tags
from refractor.envs.rewards import Rubric
from .helpers import normalize

REQUIRED_PACKAGES = ["numpy"]


class ReverseEnvironment(SingleTurnEnvironment):
    metrics_ranges = {"correct": {"min": 0, "max": 1, "invert": False}}

    def __init__(self, **kwargs):
        super().__init__(system_prompt="Answer in <answer> tags.", **kwargs)
        self.rubric = Rubric()
        self.rubric.add_reward(self.correct)
        self.rubric.add_metric(self.length)

    def load_dataset(self, num_samples=-1, **kwargs):
        words = ["abc", "hello", "level"]
        self._samples = [Sample(prompt=f"Reverse '{w}'.", answer=w[::-1]) for w in words]
        return self._samples[:num_samples] if num_samples > 0 else self._samples

    def correct(self, completion, sample):
        return float(normalize(extract_answer_tags(completion)) == sample.answer), sample.answer

    async def length(self, completion):
        return float(len(completion))

    async def compute_reward(self, completion, sample, eos_token=""):
        return await self.rubric.score(completion=completion, sample=sample, eos_token=eos_token)
"""


def write_env(root, name, body, extra_files=None):
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "environment.py").write_text(textwrap.dedent(body))
    for filename, text in (extra_files or {}).items():
        (folder / filename).write_text(text)
    return folder


@pytest.fixture
def env_dir(tmp_path, monkeypatch):
    root = tmp_path / "my_envs"
    write_env(
        root, "reverse", USER_ENV, {"helpers.py": "def normalize(s):\n    return (s or '').strip().lower()\n"}
    )
    monkeypatch.setenv(ENV_PATH_VAR, str(root))
    return root


def test_user_environment_is_discovered_and_scored(env_dir):
    specs = discover()
    assert specs["reverse"].source == "folder" and specs["reverse"].required_packages == ["numpy"]
    env = get_environment("reverse")
    assert env.name == "reverse" and len(env) == 3
    sample = env.get_sample(1)
    assert env.get_initial_prompt(sample)[0] == {"role": "system", "content": "Answer in <answer> tags."}
    outcome = asyncio.run(
        score_rollout(env, finished_state(env, sample, "<answer> OLLEH </answer>"), timeout_s=10)
    )
    assert outcome.ok and outcome.result.total_reward == 1.0
    assert outcome.result.sample_metrics == {"correct": 1.0, "length": 24.0}
    assert outcome.result.golden_answers["correct"] == "olleh"


def test_default_environments_folder_in_cwd(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_PATH_VAR, raising=False)
    write_env(
        tmp_path / "environments",
        "cwd_env",
        USER_ENV.replace("from .helpers import normalize", "normalize = str.strip"),
    )
    monkeypatch.chdir(tmp_path)
    assert discover()["cwd_env"].source == "folder"
    assert load_environment_class("cwd_env").__name__ == "ReverseEnvironment"


def test_missing_required_package_gives_install_hint(env_dir):
    write_env(
        env_dir,
        "needs_pkg",
        'REQUIRED_PACKAGES = ["surely-not-installed-pkg"]\nraise RuntimeError("never imported")\n',
    )
    assert discover()["needs_pkg"].missing_packages == ["surely-not-installed-pkg"]
    with pytest.raises(ImportError, match="pip install surely-not-installed-pkg"):
        get_environment("needs_pkg")


def test_class_choice_is_unambiguous(env_dir):
    two = (
        USER_ENV.replace("from .helpers import normalize", "normalize = str.strip")
        + "\n\nclass OtherEnvironment(ReverseEnvironment):\n    pass\n"
    )
    write_env(env_dir, "two_classes", two)
    with pytest.raises(TypeError, match="defines several.*ENVIRONMENT_CLASS"):
        load_environment_class("two_classes")
    write_env(env_dir, "marked", two + "\nENVIRONMENT_CLASS = OtherEnvironment\n")
    assert load_environment_class("marked").__name__ == "OtherEnvironment"
    # a class imported from elsewhere is not a candidate: this module's own class is chosen
    write_env(
        env_dir,
        "importer",
        "from refractor.envs.builtin.countdown import CountdownEnvironment\n"
        "class Mine(CountdownEnvironment):\n    pass\n",
    )
    assert load_environment_class("importer").__name__ == "Mine"
    write_env(env_dir, "empty", "X = 1\n")
    with pytest.raises(TypeError, match="defines no concrete Environment"):
        load_environment_class("empty")


def test_unknown_name_lists_known_and_search_path(env_dir):
    with pytest.raises(LookupError, match="unknown environment 'nope'.*countdown.*REFRACTOR_ENV_PATH"):
        get_environment("nope")
    with pytest.raises(TypeError, match="bad kwargs"):
        get_environment("countdown", not_a_kwarg=1)


def test_entry_point_environments(tmp_path, monkeypatch):
    site = tmp_path / "site"
    (site / "ep_envs_pkg").mkdir(parents=True)
    (site / "ep_envs_pkg" / "__init__.py").write_text(
        USER_ENV.replace("from .helpers import normalize", "normalize = str.strip")
    )
    dist = site / "ep_envs_pkg-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-envs-pkg\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[refractor.environments]\nep_reverse = ep_envs_pkg:ReverseEnvironment\nep_module = ep_envs_pkg\n"
    )
    monkeypatch.syspath_prepend(str(site))
    specs = discover()
    assert specs["ep_reverse"].source == "entry_point"
    assert get_environment("ep_reverse").name == "ep_reverse"
    assert load_environment_class("ep_module").__name__ == "ReverseEnvironment"
    sys.modules.pop("ep_envs_pkg", None)


def test_envs_cli_lists_environments(env_dir):
    from refractor.cli import app

    result = CliRunner().invoke(app, ["envs"])
    assert result.exit_code == 0, result.output
    for expected in (
        "countdown",
        "wordle",
        "multi-turn",
        "calculator_tools",
        "tool",
        "reverse",
        "folder",
        "2000",
    ):
        assert expected in result.output

"""Eval sources: built-ins, user folders ($REFRACTOR_EVAL_PATH, ./evals), EVAL_CLASS selection,
evals wrapping an environment, and the fallback to environments."""

from __future__ import annotations

import asyncio
import textwrap

import pytest

from refractor.envs.base import Environment
from refractor.envs.registry import EnvironmentNotFoundError
from refractor.evals import EVAL_PATH_VAR, Eval, discover_evals, list_evals, resolve_eval
from refractor.records import RolloutState, Sample, TrajectoryStep

STANDALONE = """
from refractor.records import EvalMetricsResult, Sample
from refractor.evals import Eval
from .words import WORDS


class EchoEval(Eval):
    def load_dataset(self, num_samples=-1, **kwargs):
        self._samples = [Sample(prompt=f"say {w}", answer=w) for w in WORDS]
        return self._samples

    async def compute_eval_metrics(self, completion, sample, eos_token=""):
        return EvalMetricsResult(metrics={"correct": float(sample.answer in completion)})
"""


def write(folder, name, source, extra=None):
    path = folder / name
    path.mkdir(parents=True)
    (path / "eval.py").write_text(textwrap.dedent(source))
    for file, text in (extra or {}).items():
        (path / file).write_text(text)
    return path


def score(env: Environment, completion: str):
    state = env.create_initial_state(env.get_sample(0))
    state.add_step(TrajectoryStep(prompt=[], completion=[{"role": "assistant", "content": completion}]))
    return asyncio.run(env.score_eval(state))


def test_builtins_are_listed_and_user_folders_come_first(tmp_path, monkeypatch):
    assert {"math500", "aime_2024", "aime_2025", "gpqa_diamond"} <= set(list_evals())
    write(
        tmp_path, "echo", STANDALONE, {"words.py": "WORDS = ['red', 'blue']\n"}
    )  # relative import of a sibling
    write(tmp_path, "math500", STANDALONE.replace("EchoEval", "MyMath"), {"words.py": "WORDS = ['x']\n"})
    monkeypatch.setenv(EVAL_PATH_VAR, str(tmp_path))
    specs = discover_evals()
    assert specs["echo"].source == "folder" and specs["math500"].source == "folder"
    echo = resolve_eval("echo")
    assert isinstance(echo, Eval) and echo.name == "echo" and len(echo) == 2 and echo.use_chat_template
    assert echo.get_initial_prompt(echo.get_sample(1)) == [{"role": "user", "content": "say blue"}]
    assert score(echo, "I say red").metrics == {"correct": 1.0}
    assert type(resolve_eval("math500")).__name__ == "MyMath"
    monkeypatch.chdir(tmp_path)  # ./evals is searched too
    write(tmp_path / "evals", "local_echo", STANDALONE, {"words.py": "WORDS = ['a']\n"})
    assert resolve_eval("local_echo", use_chat_template=False).use_chat_template is False


def test_class_selection_is_unambiguous(tmp_path, monkeypatch):
    two = (
        STANDALONE.replace("from .words import WORDS", "WORDS = ['a']")
        + "\n\nclass Other(EchoEval):\n    pass\n"
    )
    write(tmp_path, "two", two)
    write(tmp_path, "marked", two + "\nEVAL_CLASS = 'Other'\n")
    write(tmp_path, "needs", "REQUIRED_PACKAGES = ['surely-not-installed-pkg']\n" + two)
    monkeypatch.setenv(EVAL_PATH_VAR, str(tmp_path))
    with pytest.raises(
        TypeError, match=r"defines several Eval subclasses \['EchoEval', 'Other'\].*EVAL_CLASS"
    ):
        resolve_eval("two")
    assert type(resolve_eval("marked")).__name__ == "Other"
    with pytest.raises(ImportError, match="pip install surely-not-installed-pkg"):
        resolve_eval("needs")


def test_environment_fallback_and_unknown_names(monkeypatch, tmp_path):
    monkeypatch.setenv(EVAL_PATH_VAR, str(tmp_path))
    env = resolve_eval("target_copy", random_targets=True, num_prompts=5)
    assert type(env).__name__ == "TargetCopyEnvironment" and env.name == "target_copy" and len(env) == 5
    result = score(env, env.get_sample(0).answer)
    assert result.metrics["match_fraction"] == 1.0  # an environment's eval metrics = its reward metrics
    with pytest.raises(EnvironmentNotFoundError, match=r"unknown eval 'nope'.*no dedicated eval.*math500"):
        resolve_eval("nope")


def test_an_eval_can_wrap_an_environment(tmp_path, monkeypatch):
    write(
        tmp_path,
        "copy_exact",
        """
        from refractor.records import EvalMetricsResult
        from refractor.evals import Eval


        class CopyExact(Eval):
            environment_name = "target_copy"
            environment_kwargs = {"random_targets": True, "num_prompts": 4}

            async def compute_eval_metrics(self, completion, sample, eos_token=""):
                return EvalMetricsResult(metrics={"exact": float(completion.strip() == sample.answer)})
        """,
    )
    monkeypatch.setenv(EVAL_PATH_VAR, str(tmp_path))
    ev = resolve_eval("copy_exact", num_prompts=3)  # instance kwargs go to the environment, over the class's
    env = resolve_eval("target_copy", random_targets=True, num_prompts=3)
    assert ev.name == "copy_exact" and len(ev) == 3 and not ev.is_multi_turn
    assert [s.prompt for s in ev.samples] == [s.prompt for s in env.samples]
    assert ev.get_initial_prompt(ev.get_sample(0)) == env.get_initial_prompt(env.get_sample(0))
    assert ev.instruction_prompt == "Copy the text exactly."  # other attributes come from the environment
    answer = ev.get_sample(0).answer
    assert score(ev, answer).metrics == {"exact": 1.0}  # the eval's own scoring wins over the env's
    assert score(ev, answer + "x").metrics == {"exact": 0.0}


def test_a_standalone_eval_without_scoring_says_what_to_implement():
    class Half(Eval):
        def load_dataset(self, num_samples=-1, **kwargs):
            self._samples = [Sample("q", "a")]
            return self._samples

    half = Half()
    state = RolloutState(sample=half.get_sample(0))
    state.add_step(TrajectoryStep(prompt=[], completion=[{"role": "assistant", "content": "a"}]))
    with pytest.raises(NotImplementedError, match="compute_eval_metrics"):
        asyncio.run(half.score_eval(state))
    with pytest.raises(TypeError, match="no training reward"):
        asyncio.run(half.score(state))


def test_the_example_config_with_evals_loads_and_its_evals_resolve():
    from pathlib import Path

    from refractor.config import load_config

    cfg = load_config(
        Path(__file__).parents[2] / "configs" / "examples" / "hendrycks_math_with_eval.yaml", {}
    )
    assert [e.name for e in cfg.evals] == ["math500", "hendrycks_math"] and cfg.eval_num_servers == 1
    math500, hendrycks = (resolve_eval(e.name, **e.kwargs) for e in cfg.evals)
    assert isinstance(math500, Eval) and math500.dataset_name == "HuggingFaceH4/MATH-500"
    assert not isinstance(hendrycks, Eval) and hendrycks.name == "hendrycks_math"  # the environment itself
    assert cfg.evals[1].separate_eval_samples and cfg.evals[1].name == cfg.environments[0].name


def test_refractor_evals_lists_builtins_and_user_folders(tmp_path):
    from typer.testing import CliRunner

    from refractor.cli import app

    write(tmp_path, "broken", "raise RuntimeError('boom')\n")
    result = CliRunner().invoke(app, ["evals", "--path", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "math500" in result.output and "HuggingFaceH4/MATH-500" in result.output
    assert "broken" in result.output and "RuntimeError: boom" in result.output

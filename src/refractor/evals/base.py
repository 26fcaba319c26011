"""The ``Eval`` base class and ``DatasetEval``, the base of the built-in evals
(docs/orchestrator.md#loading).

An ``Eval`` is an :class:`~refractor.envs.base.Environment` that is only evaluated, never trained
on, so the orchestrator drives it with the training rollout code (one turn protocol) and scores it
with ``compute_eval_metrics``. Two kinds:

* **standalone**: implement ``load_dataset(num_samples=-1)`` (set ``self._samples``) and
  ``async compute_eval_metrics(completion, sample, eos_token="") -> EvalMetricsResult``; the prompt
  is the sample's text (single turn, no system prompt unless ``system_prompt`` is set);
* **wrapping an environment**: set ``environment_name`` (and ``environment_kwargs``), as class
  attributes or constructor kwargs. The environment's dataset, prompts, turns and eval metrics are
  used; what the subclass defines itself wins, and other attributes are read from the environment.

Chat template: prompts are rendered with the model's chat template, like training prompts, so a
chat-tuned or RL-trained policy is measured on the format it was trained on
(docs/config.md#deliberate-differences); ``use_chat_template = False`` (class attribute or
``kwargs: {use_chat_template: false}``) restores the raw prompt for single-turn evals.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from refractor.envs.base import Environment, strip_eos
from refractor.envs.data import DatasetLoadError, load_rows, take
from refractor.records import EvalMetricsResult, Sample

# Protocol members taken from the wrapped environment unless the Eval subclass defines them.
_WRAPPED_METHODS = (
    "load_dataset",
    "get_initial_prompt",
    "create_initial_state",
    "env_response",
    "is_done",
    "get_next_prompt_messages",
    "compute_reward",
    "compute_eval_metrics",
    "prepare_resources",
    "close",
)
_WRAPPED_ATTRS = (
    "is_multi_turn",
    "max_turns",
    "system_prompt",
    "eos_token",
    "metrics_ranges",
    "tags_options",
    "add_thinking_prefix",
)


class Eval(Environment):
    environment_name: ClassVar[str | None] = None
    environment_kwargs: ClassVar[dict[str, Any]] = {}
    use_chat_template: bool = True

    def __init__(
        self,
        environment_name: str | None = None,
        environment_kwargs: dict[str, Any] | None = None,
        use_chat_template: bool | None = None,
        **kwargs: Any,
    ) -> None:
        if use_chat_template is not None:
            self.use_chat_template = bool(use_chat_template)
        self.env: Environment | None = None
        wrapped = environment_name or type(self).environment_name
        if wrapped is None:
            super().__init__(**kwargs)
            return
        from refractor.envs.registry import get_environment

        self._name = None  # set before the base __init__, which would otherwise read the env's name
        self.env = get_environment(
            wrapped, **{**type(self).environment_kwargs, **(environment_kwargs or {}), **kwargs}
        )
        super().__init__()
        own = {name for klass in type(self).__mro__[: type(self).__mro__.index(Eval)] for name in vars(klass)}
        for name in (*_WRAPPED_METHODS, *_WRAPPED_ATTRS):
            if name not in own:
                setattr(self, name, getattr(self.env, name))

    def __getattr__(self, name: str) -> Any:  # only reached when normal lookup fails
        env = self.__dict__.get("env")
        if env is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(env, name)

    def load_dataset(self, num_samples: int = -1, **kwargs: Any) -> list[Sample]:
        raise NotImplementedError(
            f"{type(self).__name__}: a standalone eval implements load_dataset(num_samples) "
            "(or set environment_name to evaluate an environment)"
        )

    async def compute_eval_metrics(
        self, completion: Any, sample: Sample | None = None, eos_token: str = ""
    ) -> EvalMetricsResult:
        raise NotImplementedError(
            f"{type(self).__name__}: a standalone eval implements "
            "async compute_eval_metrics(completion, sample, eos_token) -> EvalMetricsResult"
        )

    async def compute_reward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"{type(self).__name__} is an eval: it has no training reward "
            "(list it under `evals:`, not `environments:`)"
        )

    def describe(self) -> dict[str, Any]:
        info = super().describe()
        info["use_chat_template"] = self.use_chat_template
        return info


class DatasetEval(Eval):
    """A standalone single-turn eval over a dataset: ``parse_row`` turns rows into samples.

    kwargs: ``dataset_name`` (an HF id, or a local .jsonl/.json/.parquet/.csv file or
    ``save_to_disk`` folder with the same columns), ``dataset_subset`` and ``dataset_split``
    (default: the built-in's own), ``verify_timeout_s``, ``use_chat_template``.
    """

    strict_kwargs = True
    dataset_id: ClassVar[str] = ""
    dataset_subsets: ClassVar[Sequence[str | None]] = (None,)  # several: rows are concatenated
    default_split: ClassVar[str] = "test"
    columns: ClassVar[Sequence[str]] = ()  # what parse_row reads (named in the offline-copy hint)

    def __init__(
        self,
        dataset_name: str | None = None,
        dataset_subset: str | None = None,
        dataset_split: str | None = None,
        verify_timeout_s: float = 5.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.dataset_name = dataset_name or self.dataset_id
        self.dataset_subsets = (
            [dataset_subset]
            if dataset_subset is not None
            else (list(self.dataset_subsets) if self.dataset_name == self.dataset_id else [None])
        )
        self.dataset_split = dataset_split or self.default_split
        self.verify_timeout_s = verify_timeout_s

    def parse_row(self, row: dict[str, Any], index: int) -> Sample | None:
        raise NotImplementedError

    def load_dataset(self, num_samples: int = -1, **kwargs: Any) -> list[Sample]:
        rows = []
        for subset in self.dataset_subsets:
            rows += self._rows(subset)
        samples = [s for i, row in enumerate(rows) if (s := self.parse_row(row, i)) is not None]
        if not samples:
            raise DatasetLoadError(
                f"eval {self.name!r}: no usable rows in {self.dataset_name!r} "
                f"(expected columns {list(self.columns)})"
            )
        self._samples = take(samples, num_samples)
        return self._samples

    def _rows(self, subset: str | None) -> list[dict[str, Any]]:
        try:
            return load_rows(self.dataset_name, subset, self.dataset_split)
        except DatasetLoadError as err:
            cause = err.__cause__ or err
            where = (
                f"{self.dataset_name!r}"
                + (f" (subset {subset!r})" if subset else "")
                + f", split {self.dataset_split!r}"
            )
            raise DatasetLoadError(
                f"eval {self.name!r}: could not load dataset {where}: {type(cause).__name__}: {cause}\n"
                f"Offline, either copy the HF datasets cache of a machine that ran "
                f"`datasets.load_dataset({self.dataset_id!r}, ...)`, or give a local copy: "
                f"`evals: [{{name: {self.name}, kwargs: {{dataset_name: /path/to/{self.name}.jsonl}}}}]` "
                f"(a .jsonl/.json/.parquet/.csv file or a save_to_disk folder with the columns "
                f"{list(self.columns)})"
            ) from None

    def answer_text(self, completion: str, eos_token: str = "") -> str:
        """The completion without a trailing end-of-sequence string."""
        return strip_eos(completion, eos_token or self.eos_token)


__all__ = ["DatasetEval", "Eval"]

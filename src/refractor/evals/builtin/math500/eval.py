"""MATH-500 (``HuggingFaceH4/MATH-500``, split ``test``): ``correct``, plus the problem's ``level``
(1-5) as a metric and its ``subject`` as a tag."""

from __future__ import annotations

from typing import Any

from refractor.evals.builtin._math import BoxedMathEval
from refractor.records import EvalMetricsResult, Sample

REQUIRED_PACKAGES = ["math-verify"]


class Math500Eval(BoxedMathEval):
    dataset_id = "HuggingFaceH4/MATH-500"
    default_split = "test"
    columns = ("problem", "answer", "level", "subject")

    def parse_row(self, row: dict[str, Any], index: int) -> Sample | None:
        sample = super().parse_row(row, index)
        if sample is not None:
            sample.metadata.update(level=row.get("level"), subject=row.get("subject"))
        return sample

    async def compute_eval_metrics(
        self, completion: str, sample: Sample, eos_token: str = ""
    ) -> EvalMetricsResult:
        result = await super().compute_eval_metrics(completion, sample, eos_token)
        level = sample.metadata.get("level")
        if isinstance(level, int | float) or (isinstance(level, str) and level.strip().isdigit()):
            result.metrics["level"] = float(level)
        if sample.metadata.get("subject"):
            result.sample_tags["subject"] = str(sample.metadata["subject"])
        return result

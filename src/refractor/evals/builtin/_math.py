"""Shared scoring of the boxed-answer math evals (math500, aime_2024, aime_2025)."""

from __future__ import annotations

from typing import Any, ClassVar

from refractor.envs.parsers import extract_boxed_answer, strip_think_tags, verify_math_answer_async
from refractor.evals.base import DatasetEval
from refractor.records import EvalMetricsResult, Sample

PROMPT_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."


class BoxedMathEval(DatasetEval):
    """Prompt = problem + Telescope's prompt suffix; ``correct`` = last ``\\boxed{}`` (after any think
    block) equals the answer under math-verify (run in a worker process, never on the event loop)."""

    metrics_ranges: ClassVar[dict[str, dict[str, Any]]] = {
        "correct": {"min": 0.0, "max": 1.0, "invert": False}
    }
    columns = ("problem", "answer")

    def parse_row(self, row: dict[str, Any], index: int) -> Sample | None:
        problem = row.get("problem", row.get("question"))
        if problem is None or row.get("answer") is None:
            return None
        return Sample(
            prompt=f"{problem}{PROMPT_SUFFIX}", answer=str(row["answer"]).strip(), metadata={"index": index}
        )

    async def correct(self, completion: str, sample: Sample, eos_token: str = "") -> float:
        predicted = extract_boxed_answer(strip_think_tags(self.answer_text(completion, eos_token)))
        ok = await verify_math_answer_async(predicted, sample.answer, timeout_s=self.verify_timeout_s)
        return 1.0 if ok else 0.0

    async def compute_eval_metrics(
        self, completion: str, sample: Sample, eos_token: str = ""
    ) -> EvalMetricsResult:
        return EvalMetricsResult(
            metrics={"correct": await self.correct(completion, sample, eos_token)},
            golden_answers={"correct": sample.answer},
        )

"""GPQA Diamond (``Idavidrein/gpqa``, subset ``gpqa_diamond``, split ``train``; gated on the Hub, so it
needs an HF login once to be cached): four-way multiple choice, the choices shuffled with a
generator seeded 42 (in dataset order), ``correct`` = the last ``Answer: X`` names the right letter."""

from __future__ import annotations

import random
import re
from typing import Any, ClassVar

from refractor.evals.base import DatasetEval
from refractor.records import EvalMetricsResult, Sample

LETTERS = "ABCD"
INSTRUCTION = (
    "Answer the following multiple choice question. The last line of your response should be of the "
    "following format: 'Answer: $LETTER' (without quotes) where LETTER is one of ABCD. "
    "Think step by step before answering."
)
_ANSWER = re.compile(r"answer\s*:\s*\(?\s*([A-D])\b", flags=re.IGNORECASE)


def last_answer_letter(text: str) -> str | None:
    found = _ANSWER.findall(text)
    return found[-1].upper() if found else None


class GpqaDiamondEval(DatasetEval):
    dataset_id = "Idavidrein/gpqa"
    dataset_subsets = ("gpqa_diamond",)
    default_split = "train"
    columns = ("Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3")
    metrics_ranges: ClassVar[dict[str, dict[str, Any]]] = {
        "correct": {"min": 0.0, "max": 1.0, "invert": False}
    }
    shuffle_seed = 42

    def load_dataset(self, num_samples: int = -1, **kwargs: Any) -> list[Sample]:
        self._rng = random.Random(self.shuffle_seed)  # one generator over the rows, in order
        return super().load_dataset(num_samples, **kwargs)

    def parse_row(self, row: dict[str, Any], index: int) -> Sample | None:
        try:
            correct = str(row["Correct Answer"]).strip()
            choices = [correct] + [str(row[f"Incorrect Answer {i}"]).strip() for i in (1, 2, 3)]
            question = str(row["Question"]).strip()
        except KeyError:
            return None
        self._rng.shuffle(choices)
        letter = LETTERS[choices.index(correct)]
        options = "\n".join(f"{LETTERS[i]}) {choice}" for i, choice in enumerate(choices))
        return Sample(
            prompt=f"{INSTRUCTION}\n\n{question}\n\n{options}",
            answer=letter,
            metadata={"index": index, "domain": row.get("High-level domain")},
        )

    async def compute_eval_metrics(
        self, completion: str, sample: Sample, eos_token: str = ""
    ) -> EvalMetricsResult:
        chosen = last_answer_letter(self.answer_text(completion, eos_token))
        tags = {"domain": str(sample.metadata["domain"])} if sample.metadata.get("domain") else {}
        return EvalMetricsResult(
            metrics={"correct": float(chosen == sample.answer)},
            golden_answers={"correct": sample.answer},
            sample_tags=tags,
        )

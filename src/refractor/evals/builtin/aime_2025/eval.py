"""AIME 2025 (``opencompass/AIME2025``, configs ``AIME2025-I`` + ``AIME2025-II``, split ``test``,
30 problems; rows have ``question`` and ``answer``): ``correct``."""

from __future__ import annotations

from refractor.evals.builtin._math import BoxedMathEval

REQUIRED_PACKAGES = ["math-verify"]


class Aime2025Eval(BoxedMathEval):
    dataset_id = "opencompass/AIME2025"
    dataset_subsets = ("AIME2025-I", "AIME2025-II")
    default_split = "test"
    columns = ("question", "answer")

"""AIME 2024 (``HuggingFaceH4/aime_2024``, split ``train``, 30 problems): ``correct``."""

from __future__ import annotations

from refractor.evals.builtin._math import BoxedMathEval

REQUIRED_PACKAGES = ["math-verify"]


class Aime2024Eval(BoxedMathEval):
    dataset_id = "HuggingFaceH4/aime_2024"
    default_split = "train"

"""Built-in dedicated evals on small local copies of their datasets (the HF ids cannot be downloaded
here): rows -> prompts, scoring, and the offline error that says how to provide the data."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from refractor.envs.data import DatasetLoadError
from refractor.evals import resolve_eval
from refractor.evals.builtin._math import PROMPT_SUFFIX

MATH500 = [
    {
        "problem": "Compute $1+1$.",
        "solution": "...",
        "answer": "2",
        "subject": "Prealgebra",
        "level": 1,
        "unique_id": "test/prealgebra/1.json",
    },
    {
        "problem": "Simplify $\\frac{6}{4}$.",
        "solution": "...",
        "answer": "\\frac{3}{2}",
        "subject": "Algebra",
        "level": 3,
        "unique_id": "test/algebra/7.json",
    },
]
AIME_2024 = [
    {
        "id": 60,
        "problem": "Find $x$ if $x^2=49$ and $x>0$.",
        "solution": "...",
        "answer": "7",
        "url": "https://example.invalid",
        "year": "2024",
    }
]
AIME_2025 = [{"question": "What is $2^{10}$ modulo $1000$?", "answer": "24"}]
GPQA = [
    {
        "Question": f"Question {i}?",
        "Correct Answer": f"right {i}",
        "Incorrect Answer 1": f"wrong1 {i}",
        "Incorrect Answer 2": f"wrong2 {i}",
        "Incorrect Answer 3": f"wrong3 {i}",
        "High-level domain": "Physics",
    }
    for i in range(6)
]


def jsonl(tmp_path, name, rows):
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def metrics(ev, completion, index=0):
    return asyncio.run(ev.compute_eval_metrics(completion, ev.get_sample(index), eos_token="<|im_end|>"))


@pytest.mark.parametrize(
    "name,rows", [("math500", MATH500), ("aime_2024", AIME_2024), ("aime_2025", AIME_2025)]
)
def test_boxed_math_evals(tmp_path, name, rows):
    ev = resolve_eval(name, dataset_name=jsonl(tmp_path, name, rows))
    assert len(ev) == len(rows)
    first = ev.get_sample(0)
    question = rows[0].get("problem", rows[0].get("question"))
    assert first.prompt == question + PROMPT_SUFFIX and first.answer == str(rows[0]["answer"])
    assert ev.get_initial_prompt(first) == [{"role": "user", "content": question + PROMPT_SUFFIX}]
    right = metrics(
        ev, f"<think>hmm \\boxed{{0}}</think> so the answer is \\boxed{{{first.answer}}}<|im_end|>"
    )
    wrong = metrics(ev, "I think it is \\boxed{999}.")
    assert right.metrics["correct"] == 1.0 and wrong.metrics["correct"] == 0.0
    assert right.golden_answers == {"correct": first.answer}
    if name == "math500":
        assert right.metrics["level"] == 1.0 and right.sample_tags == {"subject": "Prealgebra"}
        assert metrics(ev, "\\boxed{1.5}", index=1).metrics["correct"] == 1.0  # math-verify: 3/2 == 1.5


def test_gpqa_shuffles_choices_reproducibly_and_reads_the_last_answer_line(tmp_path):
    ev = resolve_eval("gpqa_diamond", dataset_name=jsonl(tmp_path, "gpqa", GPQA))
    again = resolve_eval("gpqa_diamond", dataset_name=jsonl(tmp_path, "gpqa", GPQA))
    letters = [s.answer for s in ev.samples]
    assert letters == [s.answer for s in again.samples]  # seeded shuffle
    assert len(set(letters)) > 1  # the right answer is not always in the same place
    sample = ev.get_sample(0)
    assert sample.prompt.startswith("Answer the following multiple choice question.")
    assert f"{sample.answer}) right 0" in sample.prompt and sample.prompt.count(") wrong") == 3
    wrong = "ABCD".replace(sample.answer, "")[0]
    assert (
        metrics(ev, f"Answer: {wrong}\nOn reflection...\nanswer: {sample.answer.lower()}").metrics["correct"]
        == 1.0
    )
    assert metrics(ev, f"Answer: {sample.answer}\nno wait\nAnswer: ({wrong})").metrics["correct"] == 0.0
    assert metrics(ev, "no idea").metrics["correct"] == 0.0


def test_missing_dataset_names_the_dataset_and_the_offline_fix(tmp_path):
    ev = resolve_eval(
        "aime_2025"
    )  # the Hub id; tests run with HF_DATASETS_OFFLINE=1 and an empty cache for it
    start = time.monotonic()
    with pytest.raises(DatasetLoadError) as err:
        ev.load_dataset()
    message = str(err.value)
    assert time.monotonic() - start < 30
    assert "eval 'aime_2025'" in message and "opencompass/AIME2025" in message and "AIME2025-I" in message
    assert (
        "kwargs: {dataset_name: /path/to/aime_2025.jsonl}" in message and "['question', 'answer']" in message
    )
    with pytest.raises(DatasetLoadError, match="no usable rows.*'problem', 'answer'"):
        resolve_eval("aime_2024", dataset_name=jsonl(tmp_path, "other", [{"text": "x"}])).load_dataset()
    with pytest.raises(TypeError, match="unknown kwargs"):
        resolve_eval("math500", data_file="x.jsonl")

"""Countdown: combine the given numbers with + - * / to reach a target.

Rewards (Telescope's names): ``_format_reward`` (1 for ``<think>..</think><answer>..</answer>``
with an arithmetic-only answer, 0.5 with other answer text, 0 otherwise) and ``_equation_reward``
(1 if the last answer uses exactly the given numbers and evaluates to the target).
The answer is evaluated by a tiny arithmetic interpreter, never ``eval``
(docs/config.md#deliberate-differences): ``**`` and ``//`` are not countdown operators and
``9**9**9**9`` would hang the scorer.

``dataset_name: procedural`` generates seeded problems offline (used by the CPU quickstart); their
difficulty is set by ``procedural_min_numbers`` / ``procedural_max_numbers`` (how many numbers, 3-4
by default), ``procedural_max_number`` (99) and ``procedural_max_target`` (999).
"""

from __future__ import annotations

import ast
import random
import re
from collections import Counter
from typing import Any

from refractor.envs.base import SingleTurnEnvironment
from refractor.envs.data import load_rows, take
from refractor.envs.parsers import extract_answer_tags
from refractor.envs.rewards import Rubric
from refractor.records import RewardResult, Sample

DEFAULT_DATASET = "Jiayi-Pan/Countdown-Tasks-3to4"
PROCEDURAL = "procedural"
SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
    "The assistant first thinks about the reasoning process in the mind and then provides the user "
    "with the answer."
)
INSTRUCTION_PROMPT = (
    "Show your work in <think> </think> tags. And return the final equation in <answer> </answer> tags, "
    "for example <answer> (1 + 2) / 3 </answer>."
)
MAX_ANSWER_CHARS = 200
_ALLOWED = re.compile(r"^[\d+\-*/().\s]+$")
_FORMAT = re.compile(
    r"^<think>((?:(?!</?think>).)*)</think>\s*<answer>((?:(?!</?answer>).)*)</answer>\s*$", re.DOTALL
)


def question_text(nums: list[int], target: int) -> str:
    return (
        f"Using the numbers {nums}, create an equation that equals {target}. You can use basic arithmetic "
        "operations (+, -, *, /) and each number can only be used once."
    )


def evaluate_arithmetic(expression: str) -> float:
    """Value of an expression of numbers, + - * /, unary +/- and parentheses; anything else raises."""

    def walk(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
            value = walk(node.operand)
            return value if isinstance(node.op, ast.UAdd) else -value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
            left = walk(node.left)
            right = walk(node.right)
            if isinstance(node.op, ast.Add):
                return left + right
            if isinstance(node.op, ast.Sub):
                return left - right
            if isinstance(node.op, ast.Mult):
                return left * right
            return left / right
        raise ValueError(f"not allowed in a countdown equation: {type(node).__name__}")

    return walk(ast.parse(expression.strip(), mode="eval"))


def equation_is_correct(answer: str | None, nums: list[int], target: float) -> bool:
    if answer is None or len(answer) > MAX_ANSWER_CHARS or not _ALLOWED.match(answer):
        return False
    if Counter(int(n) for n in re.findall(r"\d+", answer)) != Counter(int(n) for n in nums):
        return False
    try:
        value = evaluate_arithmetic(answer)
    except (ValueError, SyntaxError, ZeroDivisionError, OverflowError, RecursionError, MemoryError):
        return False
    return abs(value - float(target)) < 1e-5


def generate_problem(
    rng: random.Random,
    min_numbers: int = 3,
    max_numbers: int = 4,
    max_number: int = 99,
    max_target: int = 999,
) -> tuple[list[int], int, str]:
    """A solvable problem: numbers, target and one solution (every number used once)."""
    while True:
        nums = [rng.randint(1, max_number) for _ in range(rng.randint(min_numbers, max_numbers))]
        order = nums[:]
        rng.shuffle(order)
        value = order[0]
        expr = str(order[0])
        for n in order[1:]:
            op = rng.choice("+-*/")
            if op == "-" and value - n <= 0:
                op = "+"
            if op == "/" and value % n != 0:
                op = "*" if value * n <= max_target else "+"
            value = {"+": value + n, "-": value - n, "*": value * n, "/": value // n}[op]
            expr = f"({expr} {op} {n})"
        if 1 <= value <= max_target:
            return nums, value, expr[1:-1] if expr.startswith("(") else expr


class CountdownEnvironment(SingleTurnEnvironment):
    strict_kwargs = True
    reward_min = 0.0
    reward_max = 2.0

    def __init__(
        self,
        system_prompt: str | None = SYSTEM_PROMPT,
        instruction_prompt: str | None = INSTRUCTION_PROMPT,
        dataset_name: str = DEFAULT_DATASET,
        dataset_subset: str | None = "default",
        dataset_split: str = "train",
        procedural_num_samples: int = 10000,
        seed: int = 0,
        procedural_min_numbers: int = 3,
        procedural_max_numbers: int = 4,
        procedural_max_number: int = 99,
        procedural_max_target: int = 999,
        **kwargs: Any,
    ) -> None:
        super().__init__(system_prompt=system_prompt, instruction_prompt=instruction_prompt, **kwargs)
        if not 2 <= procedural_min_numbers <= procedural_max_numbers:
            raise ValueError(
                "countdown: need 2 <= procedural_min_numbers <= procedural_max_numbers, got "
                f"{procedural_min_numbers} and {procedural_max_numbers}"
            )
        if procedural_max_number < 1 or procedural_max_target < 1:
            raise ValueError(
                "countdown: procedural_max_number and procedural_max_target must be >= 1, got "
                f"{procedural_max_number} and {procedural_max_target}"
            )
        # the procedural problems' difficulty: how many numbers, how large, how large the target
        self.procedural_shape = {
            "min_numbers": procedural_min_numbers,
            "max_numbers": procedural_max_numbers,
            "max_number": procedural_max_number,
            "max_target": procedural_max_target,
        }
        self.dataset_name = dataset_name
        self.dataset_subset = dataset_subset
        self.dataset_split = dataset_split
        self.procedural_num_samples = procedural_num_samples
        self.seed = seed
        self.rubric = Rubric()
        self.rubric.add_reward(self._format_reward, range_min=0.0, range_max=1.0)
        self.rubric.add_reward(self._equation_reward, range_min=0.0, range_max=1.0)

    @property
    def metrics_ranges(self) -> dict[str, dict[str, Any]]:
        return self.rubric.metrics_ranges

    def load_dataset(self, num_samples: int = -1, **kwargs: Any) -> list[Sample]:
        if self.dataset_name == PROCEDURAL:
            rng = random.Random(self.seed)
            count = num_samples if num_samples > 0 else self.procedural_num_samples
            rows = []
            for _ in range(count):
                nums, target, solution = generate_problem(rng, **self.procedural_shape)
                rows.append({"nums": nums, "target": target, "solution": solution})
        else:
            rows = take(load_rows(self.dataset_name, self.dataset_subset, self.dataset_split), num_samples)
        self._samples = [self.sample_from_row(row) for row in rows]
        return self._samples

    @staticmethod
    def sample_from_row(row: dict[str, Any]) -> Sample:
        nums = [int(n) for n in row["nums"]]
        target = int(row["target"])
        metadata = {"nums": nums, "target": target}
        if row.get("solution"):
            metadata["solution"] = row["solution"]
        return Sample(prompt=question_text(nums, target), answer=str(target), metadata=metadata)

    def _format_reward(self, completion: str) -> float:
        text = completion if completion.lstrip().startswith("<think>") else "<think>" + completion
        match = _FORMAT.match(text.strip())
        if match is None:
            return 0.0
        return 1.0 if _ALLOWED.match(match.group(2).strip() or "x") else 0.5

    def _equation_reward(self, completion: str, sample: Sample) -> tuple[float, str]:
        target = sample.metadata["target"]
        correct = equation_is_correct(extract_answer_tags(completion), sample.metadata["nums"], target)
        return (1.0 if correct else 0.0), str(target)

    async def compute_reward(self, completion: str, sample: Sample, eos_token: str = "") -> RewardResult:
        return await self.rubric.score(completion=completion, sample=sample, eos_token=eos_token)

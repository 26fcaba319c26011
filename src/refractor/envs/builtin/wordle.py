"""Wordle, multi-turn: the model guesses a 5-letter word; the environment answers
with G/Y/X feedback in TextArena's words. Own game logic (TextArena's rules and texts; TextArena
itself needs nltk downloads at import, which offline machines cannot do); secret words and the
dictionary come from a shipped list (``word_list`` kwarg: another file, one word per line).

Rewards (Telescope's names): ``_reward_correct`` (last guess is the secret), ``_reward_partial``
(if not correct: 0.2 per green + 0.1 per yellow of the last feedback), ``_reward_length``
(1 / number of guesses when correct), ``format_reward`` (weight 0.2: per model message 0.4 for a
``<guess>[word]</guess>`` field, 0.2 for no stray spaces inside it, 0.2 for starting with
``<think>``, 0.2 for ending with ``</guess>``; averaged over messages). Maximum 2.2.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from refractor.envs.base import MultiTurnEnvironment
from refractor.envs.data import BUILTIN_DATA_DIR
from refractor.envs.parsers import extract_xml_tag, strip_think_tags
from refractor.envs.rewards import Rubric
from refractor.records import Messages, RewardResult, RolloutState, Sample

SYSTEM_PROMPT = (
    "You are a competitive game player. Make sure you read the game instructions carefully, and always "
    "follow the required format. In each turn, think step by step inside <think>...</think>, then give "
    "your guess inside <guess>...</guess> tags, with the word in square brackets, e.g. "
    "<guess>[apple]</guess>."
)


def initial_observation(word_length: int = 5, num_guesses: int = 6) -> str:
    return (
        f"You are Playing Wordle.\nA secret {word_length}-letter word has been chosen. "
        f"You have {num_guesses} attempts to guess it.\n"
        "For each guess, wrap your word in square brackets (e.g., '[apple]').\n"
        "Feedback for each letter will be given as follows:\n"
        "  - G (green): correct letter in the correct position\n"
        "  - Y (yellow): letter exists in the word but in the wrong position\n"
        "  - X (wrong): letter is not in the word\n"
        "Enter your guess to begin.\n"
    )


def score_guess(guess: str, secret: str) -> list[str]:
    """G/Y/X per letter; a repeated letter is yellow only as often as the secret has it spare."""
    feedback: list[str | None] = [None] * len(guess)
    spare = list(secret)
    for i, letter in enumerate(guess):
        if letter == secret[i]:
            feedback[i] = "G"
            spare[i] = None
    for i, letter in enumerate(guess):
        if feedback[i] is None:
            if letter in spare:
                feedback[i] = "Y"
                spare[spare.index(letter)] = None
            else:
                feedback[i] = "X"
    return feedback  # type: ignore[return-value]


@dataclass
class WordleGame:
    secret: str
    dictionary: frozenset[str]
    num_guesses: int = 6
    error_allowance: int = 1
    history: list[tuple[str, list[str]]] = field(default_factory=list)
    consecutive_errors: int = 0
    game_over: bool = False
    won: bool = False
    last_guess: str | None = None  # last parsed guess, valid or not

    def _invalid(self, reason: str) -> str:
        self.consecutive_errors += 1
        if self.consecutive_errors > self.error_allowance:
            self.game_over = True
            return f"You made too many invalid moves. Reason: {reason} The game is over."
        return (
            f"You attempted an invalid move. Reason: {reason} Please resubmit a valid move and remember to "
            "follow the game rules to avoid penalties."
        )

    def play(self, action: str) -> str:
        """Apply one move and return the observation text."""
        match = re.search(r"\[(\w+)\]", action)
        if match is None:
            return self._invalid(
                "You tried submitting a word in the wrong format. Please make sure to use squared brackets."
            )
        word = match.group(1).lower()
        self.last_guess = word
        if len(word) != len(self.secret):
            return self._invalid(f"Your word must be exactly {len(self.secret)} letters.")
        if word in (w for w, _ in self.history):
            return self._invalid(f"You have already guessed '{word}' before. Please try a different word.")
        if self.dictionary and word not in self.dictionary:
            return self._invalid(f"'{word}' is not an English word.")
        self.consecutive_errors = 0
        feedback = score_guess(word, self.secret)
        self.history.append((word, feedback))
        if all(f == "G" for f in feedback):
            self.game_over = True
            self.won = True
            return "Congratulations! You guessed the word correctly!"
        left = self.num_guesses - len(self.history)
        text = (
            f"You submitted [{word}].\nFeedback:\n{' '.join(word.upper())}\n{' '.join(feedback)}\n"
            f"You have {left} guesses left."
        )
        if left <= 0:
            self.game_over = True
            text += f"\nThe turn limit has been reached. The secret word was: **{self.secret}**."
        return text


def load_word_list(path: str | Path | None = None) -> list[str]:
    source = Path(path) if path else BUILTIN_DATA_DIR / "wordle_words.txt"
    words = sorted({w.strip().lower() for w in source.read_text().split() if w.strip().isalpha()})
    if not words:
        raise ValueError(f"word list {source} is empty")
    return words


class WordleEnvironment(MultiTurnEnvironment):
    strict_kwargs = True
    dataset_is_generated: ClassVar[bool] = True
    reward_min = 0.0
    reward_max = 2.2

    def __init__(
        self,
        system_prompt: str | None = SYSTEM_PROMPT,
        max_turns: int = 10,
        num_samples: int = 2000,
        seed: int = 0,
        word_list: str | None = None,
        num_guesses: int = 6,
        check_dictionary: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(max_turns=max_turns, system_prompt=system_prompt, **kwargs)
        self.num_samples = num_samples
        self.seed = seed
        self.num_guesses = num_guesses
        self.words = load_word_list(word_list)
        self.dictionary = frozenset(self.words) if check_dictionary else frozenset()
        self.rubric = Rubric()
        self.rubric.add_reward(self._reward_correct, range_min=0.0, range_max=1.0)
        self.rubric.add_reward(self._reward_partial, range_min=0.0, range_max=1.0)
        self.rubric.add_reward(self._reward_length, range_min=0.0, range_max=1.0)
        self.rubric.add_reward(self.format_reward, 0.2, range_min=0.0, range_max=1.0)

    @property
    def metrics_ranges(self) -> dict[str, dict[str, Any]]:
        return self.rubric.metrics_ranges

    def load_dataset(self, num_samples: int = -1, **kwargs: Any) -> list[Sample]:
        rng = random.Random(self.seed)
        count = num_samples if num_samples > 0 else self.num_samples
        prompt = initial_observation(5, self.num_guesses)
        self._samples = [Sample(prompt=prompt, answer=rng.choice(self.words)) for _ in range(count)]
        return self._samples

    def game(self, state: RolloutState) -> WordleGame:
        if "wordle" not in state.custom:
            state.custom["wordle"] = WordleGame(
                state.sample.answer.lower(), self.dictionary, self.num_guesses
            )
        return state.custom["wordle"]

    async def env_response(self, messages: Messages, state: RolloutState) -> Messages:
        guess_field = extract_xml_tag(strip_think_tags(str(messages[-1].get("content") or "")), "guess") or ""
        observation = self.game(state).play(guess_field)
        text = (
            observation.split("Feedback:", 1)[1].lstrip("\n") if "Feedback:" in observation else observation
        )
        return [{"role": "user", "content": text, "turn_type": "feedback"}]

    def is_done(self, state: RolloutState) -> tuple[bool, str | None]:
        game = self.game(state)
        if game.game_over:
            return True, "won" if game.won else "game_over"
        return super().is_done(state)

    # ----- rewards -----------------------------------------------------------------------------
    def _reward_correct(self, state: RolloutState) -> tuple[float, str]:
        game = self.game(state)
        return float(game.last_guess == game.secret), game.secret

    def _reward_partial(self, state: RolloutState) -> float:
        game = self.game(state)
        if game.last_guess == game.secret or not game.history:
            return 0.0
        feedback = game.history[-1][1]
        return 0.2 * feedback.count("G") + 0.1 * feedback.count("Y")

    def _reward_length(self, state: RolloutState) -> float:
        game = self.game(state)
        return 1.0 / len(game.history) if game.won and game.history else 0.0

    def format_reward(self, state: RolloutState) -> float:
        scores = []
        for step in state.trajectory:
            text = step.completion_text.strip()
            field_text = extract_xml_tag(text, "guess")
            score = 0.0
            if field_text is not None and re.search(r"\[[A-Za-z]+\]", field_text):
                score += 0.4
                if field_text == field_text.strip():
                    score += 0.2
            score += 0.2 if text.startswith("<think>") else 0.0
            score += 0.2 if text.endswith("</guess>") else 0.0
            scores.append(score)
        return sum(scores) / len(scores) if scores else 0.0

    async def compute_reward(self, state: RolloutState, eos_token: str = "") -> RewardResult:
        game = self.game(state)
        return await self.rubric.score(
            state=state, eos_token=eos_token, extra_sample_metrics={"num_guesses": float(len(game.history))}
        )

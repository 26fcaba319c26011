"""Text parsers shared by environments: think tags, boxed answers, answer/xml tags, code blocks,
exact and mathematical answer checks."""

from __future__ import annotations

import logging
import re
import threading

logger = logging.getLogger(__name__)

MAX_MATH_ANSWER_CHARS = 500


def strip_think_tags(text: str) -> str:
    """The text after the last ``</think>``; unchanged when there is none."""
    idx = text.rfind("</think>")
    return text[idx + len("</think>") :] if idx >= 0 else text


def extract_boxed_answer(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (brace-matched); falls back to a bare ``boxed{``."""
    start = text.rfind("\\boxed{")
    opener = len("\\boxed{")
    if start < 0:
        start = text.rfind("boxed{")
        opener = len("boxed{")
        if start < 0:
            return None
    depth = 1
    i = start + opener
    while i < len(text):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + opener : i]
        i += 1
    return None  # unbalanced


def extract_xml_tag(text: str, tag: str) -> str | None:
    """Content of the last ``<tag>...</tag>`` (case-sensitive tag, any content)."""
    matches = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", text, flags=re.DOTALL)
    return matches[-1] if matches else None


def extract_answer_tags(text: str) -> str | None:
    """Content of the last ``<answer>...</answer>``, stripped."""
    found = extract_xml_tag(text, "answer")
    return found.strip() if found is not None else None


_FENCE = re.compile(r"```([\w+#.-]*)[^\S\n]*\n(.*?)```", flags=re.DOTALL)


def extract_code_block(text: str, language: str | None = "python") -> str | None:
    """The last fenced block of ``language``, else the last fenced block of any language."""
    blocks = _FENCE.findall(text)
    if not blocks:
        return None
    if language:
        tagged = [body for lang, body in blocks if lang.lower() == language.lower()]
        if tagged:
            return tagged[-1]
    return blocks[-1][1]


def verify_exact_match(prediction: str | None, ground_truth: str | None) -> bool:
    """Equality after collapsing whitespace."""
    if prediction is None or ground_truth is None:
        return False
    return " ".join(prediction.split()) == " ".join(ground_truth.split())


def _math_verify_inline(prediction: str, ground_truth: str, timeout_s: float | None) -> bool:
    try:
        from math_verify import parse, verify
    except ImportError as err:
        raise ImportError("math answer checking needs math-verify: pip install 'refractor[math]'") from err
    seconds = None if timeout_s is None else max(1, int(timeout_s))
    gold = parse(f"\\boxed{{{ground_truth}}}", parsing_timeout=seconds)
    pred = parse(f"\\boxed{{{prediction}}}", parsing_timeout=seconds)
    if not gold or not pred:
        return verify_exact_match(prediction, ground_truth)
    return bool(verify(gold, pred, timeout_seconds=seconds))


def verify_math_answer_local(
    prediction: str | None, ground_truth: str | None, timeout_s: float = 5.0
) -> bool:
    """math-verify in the calling thread: signal timeouts in the main thread, none elsewhere.
    Worker processes of ``ProcessRunner`` call this (there it is always the main thread)."""
    if not prediction or not ground_truth or len(prediction) > MAX_MATH_ANSWER_CHARS:
        return False
    in_main = threading.current_thread() is threading.main_thread()
    try:
        return _math_verify_inline(prediction, ground_truth, timeout_s if in_main else None)
    except ImportError:
        raise
    except Exception as err:  # parse errors, timeouts: fall back to a safe exact comparison
        logger.debug("math-verify failed (%s); exact-match fallback", err)
        return verify_exact_match(prediction, ground_truth)


def verify_math_answer(prediction: str | None, ground_truth: str | None, timeout_s: float = 5.0) -> bool:
    """Is ``prediction`` mathematically equal to ``ground_truth``? (math-verify, safe fallback)

    Empty or over-long (> 500 chars) predictions are wrong. In the main thread math-verify runs
    inline with its own timeouts; from other threads (where its signal timeouts cannot work) the
    check runs in a worker process with a hard timeout. Any failure falls back to exact match.
    """
    if not prediction or not ground_truth or len(prediction) > MAX_MATH_ANSWER_CHARS:
        return False
    if threading.current_thread() is threading.main_thread():
        return verify_math_answer_local(prediction, ground_truth, timeout_s)
    from refractor.envs.runners import shared_process_runner

    try:
        return bool(
            shared_process_runner().run_sync(
                verify_math_answer_local, prediction, ground_truth, timeout_s, timeout_s=4 * timeout_s + 10
            )
        )
    except ImportError:
        raise
    except Exception as err:
        logger.debug("math verification worker failed (%s); exact-match fallback", err)
        return verify_exact_match(prediction, ground_truth)


async def verify_math_answer_async(
    prediction: str | None, ground_truth: str | None, timeout_s: float = 5.0
) -> bool:
    """``verify_math_answer`` for async rewards: runs in a worker process, never blocks the loop."""
    if not prediction or not ground_truth or len(prediction) > MAX_MATH_ANSWER_CHARS:
        return False
    from refractor.envs.runners import shared_process_runner

    try:
        return bool(
            await shared_process_runner().run(
                verify_math_answer_local, prediction, ground_truth, timeout_s, timeout_s=4 * timeout_s + 10
            )
        )
    except ImportError:
        raise
    except Exception as err:
        logger.debug("math verification worker failed (%s); exact-match fallback", err)
        return verify_exact_match(prediction, ground_truth)

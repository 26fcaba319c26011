import threading

import pytest

from refractor.envs.parsers import (
    extract_answer_tags,
    extract_boxed_answer,
    extract_code_block,
    extract_xml_tag,
    strip_think_tags,
    verify_exact_match,
    verify_math_answer,
)


def test_strip_think_tags_takes_text_after_last_close():
    assert strip_think_tags("<think>a</think> b </think> c") == " c"
    assert strip_think_tags("no tags") == "no tags"


def test_boxed_answer_brace_matching_and_fallback():
    assert extract_boxed_answer(r"x \boxed{1} then \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert extract_boxed_answer("answer: boxed{42}") == "42"
    assert extract_boxed_answer(r"\boxed{unbalanced") is None
    assert extract_boxed_answer("nothing") is None


def test_answer_and_xml_tags_take_last_match():
    assert extract_answer_tags("<answer> 1 </answer><answer> 2+3 </answer>") == "2+3"
    assert extract_answer_tags("<answer>open") is None
    assert extract_xml_tag("<guess>[a]</guess>x<guess>[b]</guess>", "guess") == "[b]"


def test_code_block_prefers_language_then_any():
    text = "```python\nA\n```\n```js\nB\n```\n```python\nC\n```"
    assert extract_code_block(text) == "C\n"
    assert extract_code_block("```\nplain\n```") == "plain\n"
    assert extract_code_block("```js\nB\n```", "python") == "B\n"
    assert extract_code_block("no code") is None


def test_exact_match_normalizes_whitespace():
    assert verify_exact_match(" a  b\n", "a b")
    assert not verify_exact_match(None, "a")


@pytest.mark.parametrize(
    ("pred", "gt", "ok"),
    [
        (r"\frac{1}{2}", "0.5", True),
        ("2", "3", False),
        ("", "1", False),
        ("1" * 600, "1", False),  # over-long answers are wrong without parsing
        (r"\sqrt{4}", "2", True),
    ],
)
def test_verify_math_answer(pred, gt, ok):
    assert verify_math_answer(pred, gt) is ok


def test_verify_math_answer_works_off_main_thread():
    results = []
    thread = threading.Thread(target=lambda: results.append(verify_math_answer(r"\frac{2}{4}", "0.5")))
    thread.start()
    thread.join(60)
    assert results == [True]

"""Math answer verification and format rewards."""

from __future__ import annotations

import pytest

from megalith.common.errors import DataError
from megalith_chat.rewards import (
    answer_format_reward,
    answers_match,
    exact_answer_reward,
    extract_answer,
    math_reward,
    parse_math,
    think_answer_format_reward,
)


def test_extract_answer_takes_last_block() -> None:
    assert extract_answer("<answer> 3 </answer> then <answer>4</answer>") == "4"
    assert extract_answer("no tags here") is None
    assert extract_answer("<answer>\n12\n</answer>") == "12"


@pytest.mark.parametrize(
    ("predicted", "reference"),
    [
        ("42", "42"),
        ("42.0", "42"),
        ("1/2", "0.5"),
        (r"\frac{1}{2}", "0.5"),
        (r"$\dfrac{3}{4}$", "0.75"),
        (r"\boxed{7}", "7"),
        ("x = 5", "5"),
        ("1,000", "1000"),
        ("2^10", "1024"),
        ("sqrt(8)", "2*sqrt(2)"),
        (r"\sqrt{8}", "2 sqrt(2)"),
        ("2x + x", "3*x"),
        ("\u22125", "-5"),
        ("3.", "3"),
    ],
)
def test_equivalent_answers_match(predicted: str, reference: str) -> None:
    assert answers_match(predicted, reference)


@pytest.mark.parametrize(
    ("predicted", "reference"),
    [("43", "42"), ("0.51", "0.5"), ("x + 1", "x"), ("", "1"), ("forty-two", "42"), ("1/0", "1")],
)
def test_different_answers_do_not_match(predicted: str, reference: str) -> None:
    assert not answers_match(predicted, reference)


@pytest.mark.parametrize(
    "hostile",
    [
        "__import__('os').system('echo pwned')",
        "eval(chr(49))",
        "x.__class__",
        "9**9**9**9",
        "2**(3**(4**5))",
        "9^9^9",
        "2**(9**99)",
        "2**99999",
        "(2**999)**999**9",
        "1" * 500,
    ],
)
def test_outside_grammar_is_never_evaluated(hostile: str) -> None:
    assert parse_math(hostile) is None
    assert not answers_match(hostile, "1")


@pytest.mark.parametrize(
    "huge",
    [
        "(9^999)^999",  # ~10^6 digits: the base is a bracketed group holding a power
        "((9^999)^999)^999",  # ~10^9 digits: would hold the GIL for minutes
        "(999*999*999*999*999*999*999*999*999*999*999*999*999*999*999*999)^999",
        "exp(exp(exp(9)))",
        "(x+1)^999",  # simplify would expand 1000 terms
        "(x+y)^30*(x+z)^30*(y+z)^30",
    ],
)
def test_oversized_answers_are_rejected_quickly(huge: str) -> None:
    """Answers inside the grammar whose value or expansion is too large score 0 without evaluation."""
    import time

    from megalith_chat.rewards import RewardRunner

    assert parse_math("1+1") is not None  # imports sympy outside the timed part
    start = time.perf_counter()
    assert parse_math(huge) is None
    assert math_reward(f"<answer>{huge}</answer>", {"answer": "1"}) == 0.0
    result = RewardRunner(timeout_s=5.0)(math_reward, f"<answer>{huge}</answer>", {"answer": "1"})
    assert result.score == 0.0 and not result.timed_out
    assert time.perf_counter() - start < 1.0, huge


@pytest.mark.parametrize(
    ("predicted", "reference"),
    [("(2^3)^2", "64"), ("sqrt(2)^12", "64"), ("9^999 / 9^998", "9"), ("(x+1)^2", "x^2 + 2x + 1")],
)
def test_small_nested_powers_still_match(predicted: str, reference: str) -> None:
    assert answers_match(predicted, reference)


def test_math_reward() -> None:
    sample = {"prompt": "What is 17 + 25?", "answer": "42"}
    assert math_reward("<think>17+25</think><answer>42</answer>", sample) == 1.0
    assert math_reward("<answer>41</answer>", sample) == 0.0
    assert math_reward("42", sample) == 0.0  # no answer tag
    with pytest.raises(DataError, match="'prompt'"):
        math_reward("<answer>42</answer>", {"prompt": "p"})


def test_exact_answer_keeps_leading_zeros() -> None:
    assert exact_answer_reward("<answer>021</answer>", {"answer": "021"}) == 1.0
    assert exact_answer_reward("<answer>21</answer>", {"answer": "021"}) == 0.0


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<think>add them</think><answer>42</answer>", 1.0),
        ("  <think>\nadd\n</think>\n<answer> 42 </answer>\n", 1.0),
        ("<answer>42</answer>", 0.0),  # no think
        ("<think>a</think><answer>42</answer> trailing", 0.0),
        ("prefix <think>a</think><answer>42</answer>", 0.0),
        ("<think> </think><answer>42</answer>", 0.0),  # blank think
        ("<think>a</think><think>b</think><answer>42</answer>", 0.0),  # tag twice
        ("<think>a</think><answer></answer>", 0.0),
    ],
)
def test_think_answer_format(completion: str, expected: float) -> None:
    assert think_answer_format_reward(completion, {}) == expected


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<answer>42</answer>", 1.0),
        ("17 + 25 is 42, so\n<answer>42</answer>\n", 1.0),
        ("<think>x</think><answer>42</answer>", 1.0),
        ("<answer>42</answer> and more text", 0.0),
        ("<answer>1</answer><answer>2</answer>", 0.0),
        ("<answer>  </answer>", 0.0),
        ("42", 0.0),
    ],
)
def test_answer_format(completion: str, expected: float) -> None:
    assert answer_format_reward(completion, {}) == expected

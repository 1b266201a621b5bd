"""Math answer verification: extract ``<answer>...</answer>`` and compare it with the reference.

Answers are compared (1) as normalised strings, (2) numerically (relative tolerance), then
(3) symbolically with sympy (``simplify(pred - ref) == 0``). Only a small whitelisted grammar is
parsed -- digits, ``+ - * / ^ ( ) .``, single-letter variables and a few function names
(``sqrt``, ``pi``, ``sin``, ...) with bounded exponents -- because ``sympy.parse_expr`` evaluates
Python; anything else counts as a wrong answer, never as code.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from megalith.common.errors import DataError

ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ALLOWED_CHARS = re.compile(r"[0-9A-Za-z+\-*/().\s]*")
_FUNCTIONS = ("sqrt", "sin", "cos", "tan", "log", "ln", "exp", "pi", "E")
_ATOM = r"(?:\d{1,3}(?:\.\d+)?(?![\d.])|[A-Za-z](?![A-Za-z]))"
# an exponent is a small number, a variable, or (atom [+-/] atom) -- never a power tower
_POWER = re.compile(rf"\*\*\s*(?:-?{_ATOM}|\(\s*-?\s*{_ATOM}(?:\s*[-+/]\s*{_ATOM})?\s*\))")
_CHAINED_POWER = re.compile(_POWER.pattern + r"\s*\*\*")
MAX_POWERS = 3
_LATEX = (
    (re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}"), r"(\1)/(\2)"),
    (re.compile(r"\\sqrt\{([^{}]*)\}"), r"sqrt(\1)"),
    (re.compile(r"\\(?:cdot|times)"), "*"),
    (re.compile(r"\\(?:left|right|,|!|;|\s)"), ""),
    (re.compile(r"\\pi"), "pi"),
)
MAX_EXPRESSION_CHARS = 200


def extract_answer(text: str) -> str | None:
    """Content of the last ``<answer>...</answer>`` block, stripped; ``None`` when there is none."""
    matches = ANSWER_RE.findall(text)
    return matches[-1].strip() if matches else None


def _unbox(text: str) -> str:
    start = text.rfind("\\boxed{")
    if start < 0:
        return text
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return text


def normalize_answer(text: str) -> str:
    """Strip LaTeX/markdown decoration so ``$\\frac{1}{2}$``, ``1/2`` and ``0.5`` can be compared."""
    s = _unbox(text.strip()).strip().strip("$").strip()
    if "=" in s:  # "x = 5" -> "5"
        s = s.rsplit("=", 1)[1]
    for pattern, repl in _LATEX:
        s = pattern.sub(repl, s)
    s = re.sub(r"(?<=\d),(?=\d{3}\b)", "", s)  # thousands separators: 1,000 -> 1000
    s = s.replace("\u2212", "-").replace("{", "(").replace("}", ")").replace("^", "**").replace("\\", "")
    return s.strip().rstrip(".").strip()


def _is_safe(expr: str) -> bool:
    if not expr or len(expr) > MAX_EXPRESSION_CHARS or not _ALLOWED_CHARS.fullmatch(expr):
        return False
    if any(len(name) > 1 and name not in _FUNCTIONS for name in re.findall(r"[A-Za-z]+", expr)):
        return False
    powers = expr.count("**")
    if powers > MAX_POWERS or len(_POWER.findall(expr)) != powers:
        return False
    return _CHAINED_POWER.search(expr) is None  # 9**9**9 is right-associative: astronomically large


@lru_cache(maxsize=4096)
def parse_math(text: str) -> Any | None:
    """Parse a normalised answer into a sympy expression, or ``None`` if it is outside the grammar."""
    import sympy
    from sympy.parsing.sympy_parser import implicit_multiplication, parse_expr, standard_transformations

    expr = normalize_answer(text)
    if not _is_safe(expr):
        return None
    names: dict[str, Any] = {
        name: getattr(sympy, name) for name in ("sqrt", "sin", "cos", "tan", "log", "exp")
    }
    names.update(ln=sympy.log, pi=sympy.pi, E=sympy.E)
    try:
        return parse_expr(
            expr, local_dict=names, transformations=(*standard_transformations, implicit_multiplication)
        )
    except (SyntaxError, TypeError, ValueError, ZeroDivisionError, AttributeError, sympy.SympifyError):
        return None


def answers_match(predicted: str, reference: str, rel_tol: float = 1e-6) -> bool:
    """Whether two answers are equal as strings, numbers (``|p - r| <= rel_tol * max(1, |r|)``) or expressions."""
    if normalize_answer(predicted) == normalize_answer(reference):
        return True
    pred, ref = parse_math(predicted), parse_math(reference)
    if pred is None or ref is None:
        return False
    import sympy

    try:
        if pred.is_number and ref.is_number:
            diff = complex(sympy.N(pred - ref))
            return abs(diff) <= rel_tol * max(1.0, abs(complex(sympy.N(ref))))
        return bool(sympy.simplify(pred - ref) == 0)
    except (TypeError, ValueError, ZeroDivisionError, OverflowError, sympy.SympifyError):
        return False


def reference_answer(sample: Mapping[str, Any]) -> str:
    """``sample['answer']`` as a string; :class:`DataError` when the record has no answer."""
    answer = sample.get("answer")
    if answer is None or (isinstance(answer, str) and not answer.strip()):
        raise DataError(
            f"this reward needs a reference 'answer' in the prompt record, got keys {sorted(sample)}"
        )
    return str(answer)


def math_reward(completion: str, sample: Mapping[str, Any]) -> float:
    """1.0 if the completion's ``<answer>`` matches ``sample['answer']`` (see :func:`answers_match`), else 0.0."""
    reference = reference_answer(sample)
    predicted = extract_answer(completion)
    return 1.0 if predicted is not None and answers_match(predicted, reference) else 0.0


def exact_answer_reward(completion: str, sample: Mapping[str, Any]) -> float:
    """1.0 if the ``<answer>`` text equals ``sample['answer']`` exactly (after stripping), else 0.0.

    For answers where form matters (e.g. the digit string ``"021"`` is not the number 21).
    """
    reference = reference_answer(sample).strip()
    predicted = extract_answer(completion)
    return 1.0 if predicted is not None and predicted == reference else 0.0

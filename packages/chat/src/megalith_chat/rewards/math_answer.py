"""Math answer verification: extract ``<answer>...</answer>`` and compare it with the reference.

Answers are compared (1) as normalised strings, (2) numerically (relative tolerance), then
(3) symbolically with sympy (``simplify(pred - ref) == 0``). Only a small whitelisted grammar is
parsed -- digits, ``+ - * / ^ ( ) .``, single-letter variables and a few function names
(``sqrt``, ``pi``, ``sin``, ...) with bounded exponents -- because ``sympy.parse_expr`` evaluates
Python; anything else counts as a wrong answer, never as code.

The grammar alone does not bound the work: ``((9^999)^999)^999`` is short, but evaluating it
builds an integer of ~10^9 digits inside one C call that holds the GIL (so no thread timeout
can interrupt it), and ``simplify((x+y+z+w)^24 - ref)`` expands thousands of terms. So the
expression is first parsed *unevaluated* and its size is bounded from the tree
(:func:`_within_limits`): ``log10 |value| <= MAX_DIGITS`` for every sub-expression
(``log10|b^e| <= |e| log10|b|``, ``log10|exp(a)| <= |a| log10(e)``, sums and products add up)
and at most ``MAX_TERMS`` monomials once expanded (``(t-term polynomial)^n`` has
``C(n + t - 1, t - 1)``). Larger answers score as wrong without being evaluated.
"""

from __future__ import annotations

import math
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
MAX_DIGITS = 10_000  # log10 bound on |value| of any sub-expression (9^999 has 954 digits)
MAX_TERMS = 100  # bound on the monomials of the expanded expression ((x+1)^99, (x+y+z)^12)


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


def _exponent(e: Any, digits: float) -> float | None:
    """``|e|`` of a numeric exponent of at most ``digits`` digits; ``None`` for a symbolic one."""
    if e.free_symbols:
        return None
    if digits > math.log10(MAX_DIGITS) + 1:  # b^e or exp(e) would have more than MAX_DIGITS digits
        return math.inf
    value = abs(complex(e.evalf(15)))
    return value if math.isfinite(value) else math.inf


def _pow_size(base: tuple[float, int], e: Any, e_digits: float, symbolic_base: bool) -> tuple[float, int]:
    """Size of ``b^e`` from the size ``(digits, terms)`` of ``b`` and the digits of ``e``."""
    digits, terms = base
    n = _exponent(e, e_digits)
    if n is None:  # b^x stays a symbolic power: no expansion, magnitude as the base's
        return digits, 1
    if n > MAX_DIGITS:
        return math.inf, 1
    out_terms = 1
    if symbolic_base and terms > 1:  # (t-term sum)^n expands into C(n + t - 1, t - 1) monomials
        k = math.ceil(n)
        out_terms = math.comb(k + terms - 1, terms - 1) if k <= MAX_TERMS else MAX_TERMS + 1
    return n * max(digits, 1.0), out_terms


def _size(node: Any) -> tuple[float, int]:
    """``(digits, terms)``: a bound on ``log10 |value|`` and on the monomials after expansion.

    ``digits`` is ``inf`` (and the walk stops) as soon as a sub-expression exceeds the limits.
    """
    import sympy

    if not node.args:  # a number, a symbol or a constant such as pi
        if node.is_Rational:
            return float(max(len(str(abs(node.p))), len(str(node.q)))), 1
        if node.is_Float:
            return abs(math.log10(abs(float(node)))) + 1.0 if node else 0.0, 1
        return 1.0, 1
    parts = [_size(a) for a in node.args]
    if any(d > MAX_DIGITS or t > MAX_TERMS for d, t in parts):
        return math.inf, 1
    if isinstance(node, sympy.Pow):
        return _pow_size(parts[0], node.args[1], parts[1][0], bool(node.args[0].free_symbols))
    if isinstance(node, sympy.exp):
        n = _exponent(node.args[0], parts[0][0])
        return (1.0, 1) if n is None else (n * math.log10(math.e) + 1.0, 1)
    if isinstance(node, sympy.Add):
        return max(d for d, _ in parts) + math.log10(len(parts)), sum(t for _, t in parts)
    if isinstance(node, sympy.Mul):
        return sum(d for d, _ in parts), math.prod(t for _, t in parts)
    return max(d for d, _ in parts), 1  # sin, log, ...: no larger than their argument's size


def _within_limits(tree: Any) -> bool:
    """Whether the unevaluated expression is small enough to evaluate (module docstring)."""
    digits, terms = _size(tree)
    return digits <= MAX_DIGITS and terms <= MAX_TERMS


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
    transformations = (*standard_transformations, implicit_multiplication)
    try:
        tree = parse_expr(expr, local_dict=names, transformations=transformations, evaluate=False)
        if not _within_limits(tree):
            return None
        return parse_expr(expr, local_dict=names, transformations=transformations)
    except (
        SyntaxError,
        TypeError,
        ValueError,
        ZeroDivisionError,
        OverflowError,
        AttributeError,
        sympy.SympifyError,
    ):
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

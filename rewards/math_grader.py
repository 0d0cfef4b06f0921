"""Math answer grading: extract the final answer from a response and decide whether it equals the label.

    extract_answer(text)  -> the last \\boxed{...} (nested braces allowed), else "the answer is X", else the last number
    is_equiv(given, truth) -> numbers, fractions (a/b, \\frac{a}{b}, \\dfrac), percentages, degrees, simple LaTeX,
                              tuples; sympy decides symbolic cases when it is installed.
    grade(response, label) -> 1.0 or 0.0
"""
import re
from fractions import Fraction

ANSWER_PHRASE = re.compile(r"(?:final answer|answer)\s*(?:is|:|=)\s*([^\n]+)", re.IGNORECASE)
NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} or \\fbox{...}, with balanced braces."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


def extract_answer(text: str) -> str | None:
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    phrases = ANSWER_PHRASE.findall(text)
    if phrases:
        return phrases[-1].strip().rstrip(".")
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _strip_latex(s: str) -> str:
    s = s.strip().strip("$").strip()
    s = re.sub(r"\\(left|right|displaystyle|!|,|;|quad)", "", s)
    s = re.sub(r"\\text\{\s*([^{}]*)\}", r"\1", s)
    s = re.sub(r"\^\{?\\circ\}?|°|\\degree", "", s)
    s = s.replace("\\%", "").replace("%", "").replace("\\$", "")
    s = re.sub(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}", r"(\1)/(\2)", s)
    s = re.sub(r"\\[dt]?frac(\d)(\d)", r"\1/\2", s)
    s = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", s)
    s = re.sub(r"^[a-zA-Z]\s*=\s*", "", s)  # "x = 3" -> "3"
    s = re.sub(r"\s*(units?|degrees?|cm|m|km|inches|feet|meters?)$", "", s)
    return s.replace(" ", "").replace("{", "").replace("}", "").replace(",", "") if not _is_tuple(s) else s


def _is_tuple(s: str) -> bool:
    return len(s) > 2 and s[0] in "([" and s[-1] in ")]" and "," in s


def _number(s: str):
    try:
        return Fraction(s.replace("(", "").replace(")", "")) if re.fullmatch(r"[-+()\d./]+", s) else None
    except (ValueError, ZeroDivisionError):
        return None


def _sympy_equal(a: str, b: str) -> bool:
    try:
        import sympy
        from sympy.parsing.sympy_parser import (implicit_multiplication_application, parse_expr,
                                                standard_transformations)
        rules = standard_transformations + (implicit_multiplication_application,)
        x, y = (parse_expr(t.replace("^", "**"), transformations=rules) for t in (a, b))
        return bool(sympy.simplify(x - y) == 0)
    except Exception:  # noqa: BLE001 - sympy missing or the text is not an expression
        return False


def is_equiv(given: str | None, truth) -> bool:
    if given is None or truth is None:
        return False
    a, b = _strip_latex(str(given)), _strip_latex(str(truth))
    if not a or not b:
        return False
    if a == b:
        return True
    if _is_tuple(a) and _is_tuple(b):
        xs, ys = a[1:-1].split(","), b[1:-1].split(",")
        return a[0] == b[0] and len(xs) == len(ys) and all(is_equiv(x, y) for x, y in zip(xs, ys))
    x, y = _number(a), _number(b)
    if x is not None and y is not None:
        return x == y
    return _sympy_equal(a, b)


def grade(response: str, label) -> float:
    if isinstance(label, dict):
        label = next((label[k] for k in ("ground_truth", "answer", "label", "target") if k in label), None)
    return float(is_equiv(extract_answer(response), label))

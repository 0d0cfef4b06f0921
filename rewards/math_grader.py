"""Math answer grading: the thin adapter the agents import. Nothing the model writes is evaluated as Python by the host.

Answers that are plain numbers (integers, decimals, fractions, percentages, degrees) are compared exactly here, with
no evaluation at all. Everything else goes to HF's math-verify (the verifier TRL and open-r1 use), with the answer
parsed as LaTeX only (its plain-expression parser would run sympy's parse_expr, which evaluates Python), in a
sandboxed worker process (rewards/sandbox.py: bubblewrap, no network, no writable host path), one fresh fork per call,
killed at a hard deadline: an answer like \\boxed{9^9^9} costs one call's time limit, never the run's. A timeout or a
parse failure scores 0 and is counted in the episode's info (reward/grader_timeouts, reward/grader_unparsed).

What runs here, on the host, is bounded before it runs: a response over RESPONSE_CHARS or an answer over ANSWER_CHARS
is unparsed, and every pattern runs in time linear in its input (tests/test_security.py times the hostile ones), so no
answer can hold the event loop's thread. Units are dropped only where they are text (`12 cm`,
`12\\text{ cm}`), never a letter written against a number (`3m` may be 3 times m); an equation `X = Y` is read as Y
only when X is a lone variable (x, y_1, \\theta, AB), and any other relation in an answer whose label has none, however
spelled, is unparsed (`3 = 2`, `3 \\equiv 2` are not the answer 2: decided on the sandbox's parse).

    extract_answer(text)   -> the last \\boxed{...}, else "the answer is X", else the last number (or None)
    check(response, label) -> Verdict(correct, timeout, unparsed)
    grade(response, label) -> 1.0 or 0.0                        (blocking: from async code, await molt.offload(grade, ...))
    is_equiv(given, truth) -> bool
"""
import os
import re
from dataclasses import dataclass
from fractions import Fraction

import molt

sandbox = molt.import_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox.py"))

TIMEOUT = float(os.environ.get("MOLT_GRADER_TIMEOUT", 5))
WORKERS = int(os.environ.get("MOLT_GRADER_WORKERS", min(4, os.cpu_count() or 1)))
ANSWER_CHARS = 2000  # a longer answer is not an answer
RESPONSE_CHARS = 1_000_000  # a longer response is not graded (unparsed)
UNITS = {"unit", "units", "degree", "degrees", "cm", "mm", "m", "km", "inch", "inches", "in", "feet", "ft", "meter",
         "meters", "metre", "metres", "cm^2", "m^2", "units^2", "sq", "square"}
TEXT_UNIT = re.compile(r"\\(?:text|mbox|mathrm)\{\s*(?:" + "|".join(sorted(map(re.escape, UNITS), key=len,
                                                                               reverse=True)) + r")\s*\}$")
LONE_VARIABLE = re.compile(r"^(?:[a-zA-Z](?:_\{?[a-zA-Z0-9]{1,8}\}?)?|\\[a-zA-Z]{2,12}|[A-Z]{2,3})\s*=\s*")
ANSWER_PHRASE = re.compile(r"(?:final answer|answer)\s*(?:is|:|=)\s*([^\n]+)", re.IGNORECASE)
NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")

# Runs inside the sandboxed worker: LaTeX parsing only, for the answer and the label alike.
# math-verify's own unit stripping is off: it would read 3m as 3 metres (units written as text are dropped on the host).
# Two rules, decided on the parse: a relation where the label has none is no value (any spelling: 3 \equiv 2 and
# 3 ≐ 2 parse to Eq(3, 2), which math-verify matched to 2), and a decimal is the exact rational it spells, as on the
# host (math-verify rounds floats: 1.4142136 was \sqrt{2}).
VERIFIER = r'''
from latex2sympy2_extended.latex2sympy2 import NormalizationConfig
from math_verify import LatexExtractionConfig, parse, verify
from sympy import Basic, Rational
from sympy.core.relational import Relational
CONFIG = [LatexExtractionConfig(boxed_match_priority=0, normalization_config=NormalizationConfig(
    basic_latex=True, units=False, malformed_operators=True, nits=True, boxed="all", equations=False))]
def exact(parsed):
    return [x.replace(lambda e: e.is_Float, lambda e: Rational(str(e))) if isinstance(x, Basic) else x for x in parsed]
def relation(parsed):
    return any(isinstance(x, Relational) for x in parsed)
def handler(req):
    gold = parse(req["gold"], extraction_config=CONFIG, parsing_timeout=None)
    answer = parse(req["answer"], extraction_config=CONFIG, parsing_timeout=None)
    if not gold or not answer or relation(answer) and not relation(gold):
        return {"correct": False, "unparsed": True}
    return {"correct": bool(verify(exact(gold), exact(answer), timeout_seconds=None)), "unparsed": False}
'''


@dataclass
class Verdict:
    correct: bool
    timeout: bool = False
    unparsed: bool = False

    def info(self) -> dict:
        return {"reward/grader_timeouts": float(self.timeout), "reward/grader_unparsed": float(self.unparsed)}


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


def _plain(s: str) -> str:
    """The answer without what never changes its value: $, \\left/\\right, \\text{}, degrees, percent, a leading
    'x =' (a lone variable), trailing units written as text, spaces and thousands separators."""
    s = s.strip().strip("$").strip()
    s = re.sub(r"\\(left|right|displaystyle|!|,|;|quad)", "", s)
    s = TEXT_UNIT.sub("", s).rstrip()
    s = re.sub(r"\\text\{([^{}]*)\}", lambda m: m.group(1).strip(), s)
    s = re.sub(r"\^\{?\\circ\}?|°|\\degree", "", s)
    s = s.replace("\\%", "").replace("%", "").replace("\\$", "")
    s = LONE_VARIABLE.sub("", s)
    head, _, unit = s.rstrip().rpartition(" ")  # "12 cm": a unit word after a space, behind a number
    if unit in UNITS and head.rstrip()[-1:].isdigit():
        s = head
    s = re.sub(r"\\[dt]?frac\{(-?\d+)\}\{(\d+)\}", r"\1/\2", s)
    return s.replace(" ", "")


def _number(s: str) -> Fraction | None:
    """An exact value for integers, decimals and a/b written plainly (or with thousands separators); else None."""
    if not re.fullmatch(r"-?\d{1,60}(?:,\d{3})*(?:\.\d{1,60})?(?:/\d{1,60})?", s):
        return None
    try:
        return Fraction(s.replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


VERIFIERS = sandbox.WorkerPool(VERIFIER, WORKERS)


def check(given: str | None, truth) -> Verdict:
    """Is the extracted answer `given` equal to `truth`? Plain numbers are compared here; the rest in the sandbox."""
    if given is None or truth is None:
        return Verdict(False)
    if len(str(given)) > ANSWER_CHARS:  # before any pattern reads it
        return Verdict(False, unparsed=True)
    a, b = _plain(str(given)), _plain(str(truth))
    if not a or not b:
        return Verdict(False, unparsed=bool(a))
    x, y = _number(a), _number(b)
    if x is not None and y is not None:
        return Verdict(x == y)
    if a == b:
        return Verdict(True)
    out = VERIFIERS.call({"gold": f"${b}$", "answer": f"${a}$"}, TIMEOUT)
    return Verdict(bool(out.get("correct")), timeout=bool(out.get("timeout")), unparsed=bool(out.get("unparsed")))


def is_equiv(given: str | None, truth) -> bool:
    return check(given, truth).correct


def label_answer(label):
    if isinstance(label, dict):
        return next((label[k] for k in ("ground_truth", "answer", "label", "target") if k in label), None)
    return label


def grade_verdict(response: str, label) -> Verdict:
    if len(response or "") > RESPONSE_CHARS:  # before any pattern reads it
        return Verdict(False, unparsed=True)
    return check(extract_answer(response or ""), label_answer(label))


def grade(response: str, label) -> float:
    return float(grade_verdict(response, label).correct)

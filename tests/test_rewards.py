"""rewards/math_grader.py: answer extraction and equivalence."""
import os

import pytest

import molt

grader = molt.import_path(os.path.join(os.path.dirname(__file__), "..", "rewards", "math_grader.py"))


@pytest.mark.parametrize("text, answer", [
    ("so \\boxed{\\frac{1}{2}} done", "\\frac{1}{2}"),
    ("first \\boxed{1} then \\boxed{{2}+3}", "{2}+3"),
    ("The answer is 42.", "42"),
    ("we get 3 apples and 7 pears", "7"),
    ("nothing numeric here", None),
])
def test_extract_answer(text, answer):
    assert grader.extract_answer(text) == answer


EQUIVALENT = [
    ("36", "36^\\circ"), ("36°", "36"), ("0.5", "\\frac{1}{2}"), ("1/2", "\\dfrac{1}{2}"), ("x = 30", "30"),
    ("3.0", "3"), ("12 cm", "12"), ("50\\%", "50"), ("(1, 2)", "(1,2)"), ("1,000", "1000"), ("\\frac{2}{4}", "0.5"),
    ("2\\sqrt{3}", "\\sqrt{12}"), ("\\frac{\\pi}{2}", "\\pi/2"), ("2x+1", "1+2x"), ("x^2-1", "(x-1)(x+1)"),
    ("\\sqrt{2}/2", "\\frac{1}{\\sqrt{2}}"), ("-3", "-3.0"), ("\\text{12}", "12"), ("3\\pi", "3 \\pi"),
    ("\\frac{3}{6}", "\\frac{1}{2}"), ("e^{0}", "1"), ("\\{1,2\\}", "\\{2,1\\}"), ("[0,1]", "[0, 1]"),
]
DIFFERENT = [
    ("36", "37"), ("0.5", "0.6"), ("12 cm", "13 cm"), ("", "5"), ("5", ""), (None, "5"), ("(1, 2)", "(2, 1)"),
    ("2\\sqrt{3}", "3\\sqrt{2}"), ("x^2", "x^3"), ("\\frac{1}{3}", "0.33"), ("2x", "2y"), ("\\pi", "3.14"),
    ("[0,1]", "(0,1)"), ("-1", "1"), ("1e3", "100"),
]


@pytest.mark.parametrize("given, truth", EQUIVALENT)
def test_equivalent(given, truth):
    assert grader.is_equiv(given, truth)


@pytest.mark.parametrize("given, truth", DIFFERENT)
def test_not_equivalent(given, truth):
    assert not grader.is_equiv(given, truth)


def test_grade_reads_dict_labels_and_reports_its_failures():
    assert grader.grade("... \\boxed{7}", {"ground_truth": "7"}) == 1.0
    assert grader.grade("... \\boxed{8}", {"ground_truth": "7"}) == 0.0
    assert len(EQUIVALENT) + len(DIFFERENT) >= 30
    unparsed = grader.grade_verdict("\\boxed{\\}", "7")
    assert not unparsed.correct and unparsed.info() == {"reward/grader_timeouts": 0.0, "reward/grader_unparsed": 1.0}

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


@pytest.mark.parametrize("given, truth", [
    ("36", "36^\\circ"), ("36°", "36"), ("0.5", "\\frac{1}{2}"), ("1/2", "\\dfrac{1}{2}"), ("x = 30", "30"),
    ("3.0", "3"), ("12 cm", "12"), ("50\\%", "50"), ("(1, 2)", "(1,2)"), ("1,000", "1000"),
    ("\\frac{2}{4}", "0.5"), ("2\\sqrt{3}", "\\sqrt{12}"),
])
def test_equivalent(given, truth):
    assert grader.is_equiv(given, truth)


@pytest.mark.parametrize("given, truth", [
    ("36", "37"), ("0.5", "0.6"), ("12 cm", "13 cm"), ("", "5"), ("5", ""), (None, "5"), ("(1, 2)", "(2, 1)"),
    ("2\\sqrt{3}", "3\\sqrt{2}"),
])
def test_not_equivalent(given, truth):
    assert not grader.is_equiv(given, truth)


def test_grade_reads_dict_labels():
    assert grader.grade("... \\boxed{7}", {"ground_truth": "7"}) == 1.0
    assert grader.grade("... \\boxed{8}", {"ground_truth": "7"}) == 0.0

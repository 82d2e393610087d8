"""pass@k against hand-computed values, and the summary's numbers and table on a small case."""

from __future__ import annotations

from fractions import Fraction
from math import comb

import pytest

from reinforge.eval.metrics import Sample, default_ks, pass_at_k, summarize_eval

# n=5 samples, c=2 correct: 1 - C(3,k)/C(5,k) = 1 - 3/5, 1 - 3/10, 1 - 1/10, 1 - 0, 1 - 0
N5_C2 = {1: 0.4, 2: 0.7, 3: 0.9, 4: 1.0, 5: 1.0}


@pytest.mark.parametrize(("k", "expected"), sorted(N5_C2.items()))
def test_pass_at_k_by_hand(k, expected):
    assert pass_at_k(5, 2, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_with_none_or_all_correct():
    assert [pass_at_k(5, 0, k) for k in range(1, 6)] == [0.0] * 5
    assert [pass_at_k(5, 5, k) for k in range(1, 6)] == [1.0] * 5


def test_pass_at_k_is_exact_where_binomials_overflow_floats():
    n, c, k = 2000, 7, 300
    exact = 1 - Fraction(comb(n - c, k), comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12)
    assert pass_at_k(200, 1, 100) == pytest.approx(0.5)


def test_pass_at_k_refuses_impossible_counts():
    with pytest.raises(ValueError, match="sample more"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="c <= n"):
        pass_at_k(4, 5, 1)


def test_default_ks():
    assert default_ks(1) == [1]
    assert default_ks(5) == [1, 2, 4, 5]
    assert default_ks(8) == [1, 2, 4, 8]


def test_summary_per_source_lengths_and_truncation():
    groups = [
        # gsm8k task 1: 2 of 4 correct, one truncated
        [
            (1.0, 10, "stop", "gsm8k"),
            (0.0, 20, "length", "gsm8k"),
            (1.0, 30, "stop", "gsm8k"),
            (0.5, 40, "stop", "gsm8k"),
        ],
        # gsm8k task 2: none correct
        [Sample(0.0, 50, "stop", "gsm8k")] * 4,
        # math task: all correct
        [Sample(1.0, 60, "stop", "math")] * 4,
    ]

    summary = summarize_eval(groups)
    m = summary.metrics

    p1 = [0.5, 0.0, 1.0]
    p2 = [1 - comb(2, 2) / comb(4, 2), 0.0, 1.0]
    assert m["pass@1"] == pytest.approx(sum(p1) / 3)
    assert m["pass@2"] == pytest.approx(sum(p2) / 3)
    assert m["pass@4"] == pytest.approx(2 / 3)
    assert m["mean@4"] == pytest.approx((2.5 / 4 + 0.0 + 1.0) / 3)
    assert m["pass@1/gsm8k"] == pytest.approx(0.25)
    assert m["pass@1/math"] == 1.0
    assert m["num_tasks/gsm8k"] == 2.0
    assert m["truncation_rate"] == pytest.approx(1 / 12)
    assert m["truncation_rate/gsm8k"] == pytest.approx(1 / 8)
    lengths = [10, 20, 30, 40] + [50] * 4 + [60] * 4
    assert m["response_len/mean"] == pytest.approx(sum(lengths) / 12)
    assert (m["response_len/min"], m["response_len/p50"], m["response_len/max"]) == (10, 50, 60)
    assert m["response_len/p90"] == 60
    assert all(isinstance(v, float) for v in m.values())

    lines = summary.table.splitlines()
    assert any("gsm8k" in line and "0.250" in line for line in lines)
    assert any(line.strip("│ ").startswith("all") and "0.500" in line for line in lines)
    assert "pass@4" in summary.table and "mean@4" in summary.table


def test_a_single_source_has_no_per_source_keys_and_k_beyond_the_samples_is_refused():
    groups = [[Sample(1.0, 3, "stop")] * 2, [Sample(0.0, 3, "stop")] * 3]
    m = summarize_eval(groups, ks=[1, 2]).metrics
    assert m["pass@1"] == 0.5 and "pass@1/all" not in m
    with pytest.raises(ValueError, match="fewest samples"):
        summarize_eval(groups, ks=[3])

from benchmarks.spec_decode import first_difference


def test_first_difference_names_request_position_and_both_gaps():
    base = [([1, 2, 3], 0.1, 0.2, [0.5, 0.4, 0.3]), ([4, 5, 6, 7], 0.1, 0.2, [0.9, 2e-6, 1.0, 1.0])]
    same = [([1, 2, 3], 0.2, 0.3, [0.5, 0.4, 0.3])]
    assert first_difference(base[:1], same) is None
    spec = [same[0], ([4, 9, 6], 0.1, 0.2, [0.9, 3e-6, 0.7])]
    assert first_difference(base, spec) == {"request": 1, "position": 1,
                                            "baseline_top2_gap": 2e-6, "spec_top2_gap": 3e-6}
    # one output a prefix of the other: the first token past the shorter; no gaps asked for
    short = [([1, 2, 3], 0, 0, []), ([4, 5, 6], 0, 0, [])]
    assert first_difference([(ids, 0, 0, []) for ids, *_ in base], short) == {
        "request": 1, "position": 3, "baseline_top2_gap": None, "spec_top2_gap": None}

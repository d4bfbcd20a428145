from slugs import slugify


def test_runs_collapse():
    assert slugify("  Rock & Roll -- 2024  ") == "rock-roll-2024"


def test_non_ascii_removed():
    assert slugify("Café déjà vu") == "caf-d-j-vu"


def test_digits_kept_and_case():
    assert slugify("Top 10 PYTHON tips") == "top-10-python-tips"


def test_nothing_left():
    assert slugify("!!!") == ""

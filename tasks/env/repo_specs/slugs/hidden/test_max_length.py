from slugs import slugify


def test_cut_at_dash():
    assert slugify("alpha beta gamma", max_length=12) == "alpha-beta"


def test_cut_exactly_at_a_word_end():
    assert slugify("alpha beta gamma", max_length=10) == "alpha-beta"


def test_no_dash_to_cut_at():
    assert slugify("abcdefghij", max_length=4) == "abcd"


def test_default_limit():
    slug = slugify("word " * 30)
    assert len(slug) <= 50 and not slug.endswith("-") and slug.startswith("word-word")

from slugs import unique_slug


def test_free_slug():
    assert unique_slug("New Post", set()) == "new-post"


def test_counts_up():
    assert unique_slug("New Post", {"new-post", "new-post-2"}) == "new-post-3"


def test_empty_slug():
    assert unique_slug("???", set()) == "n-a"
    assert unique_slug("???", {"n-a"}) == "n-a-2"

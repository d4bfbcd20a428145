from slugs import slugify, unique_slug


def test_slugify_example():
    assert slugify("Hello, World!") == "hello-world"


def test_unique_example():
    assert unique_slug("Hello", {"hello"}) == "hello-2"

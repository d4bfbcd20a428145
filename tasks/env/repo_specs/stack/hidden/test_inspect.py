from stack import Stack, StackEmpty, StackFull


def test_is_empty():
    s = Stack()
    assert s.is_empty()
    s.push(0)
    assert not s.is_empty()


def test_items_bottom_to_top_is_a_copy():
    s = Stack()
    s.push("a")
    s.push("b")
    items = s.items()
    items.append("c")
    assert s.items() == ["a", "b"]


def test_errors_are_exceptions():
    assert issubclass(StackEmpty, Exception) and issubclass(StackFull, Exception)

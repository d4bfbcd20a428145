from stack import Stack


def test_push_pop_example():
    s = Stack()
    s.push(1)
    s.push(2)
    assert s.pop() == 2


def test_len_example():
    s = Stack()
    s.push("a")
    assert len(s) == 1

class StackEmpty(Exception):
    pass


class StackFull(Exception):
    pass


class Stack:
    def __init__(self, limit=None):
        if limit is not None and limit < 1:
            raise ValueError("limit must be at least 1")
        self.limit = limit
        self._items = []

    def push(self, item):
        if self.limit is not None and len(self._items) >= self.limit:
            raise StackFull("stack is full")
        self._items.append(item)

    def pop(self):
        if not self._items:
            raise StackEmpty("stack is empty")
        return self._items.pop()

    def peek(self):
        if not self._items:
            raise StackEmpty("stack is empty")
        return self._items[-1]

    def is_empty(self):
        return not self._items

    def items(self):
        return list(self._items)

    def __len__(self):
        return len(self._items)

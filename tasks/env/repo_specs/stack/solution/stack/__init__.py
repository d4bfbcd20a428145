from stack.core import Stack, StackEmpty, StackFull

__all__ = ["Stack", "StackEmpty", "StackFull"]

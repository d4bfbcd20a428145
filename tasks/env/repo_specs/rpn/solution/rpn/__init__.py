from rpn.calc import evaluate
from rpn.errors import RPNError
from rpn.tokens import tokenize

__all__ = ["RPNError", "evaluate", "tokenize"]

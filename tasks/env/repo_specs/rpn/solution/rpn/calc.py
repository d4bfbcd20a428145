from rpn.errors import RPNError
from rpn.tokens import tokenize


def _apply(op, a, b):
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if op == "/":
        if b == 0:
            raise RPNError("division by zero")
        return a / b
    return a**b


def evaluate(expr):
    stack = []
    for tok in tokenize(expr):
        if isinstance(tok, str):
            if len(stack) < 2:
                raise RPNError(f"{tok} needs two values")
            b = stack.pop()
            a = stack.pop()
            stack.append(_apply(tok, a, b))
        else:
            stack.append(tok)
    if len(stack) != 1:
        raise RPNError(f"{len(stack)} values left, expected 1")
    return stack[0]

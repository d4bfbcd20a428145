from rpn.errors import RPNError

OPERATORS = ("+", "-", "*", "/", "^")


def tokenize(expr):
    out = []
    for tok in expr.split():
        if tok in OPERATORS:
            out.append(tok)
            continue
        try:
            out.append(int(tok))
        except ValueError:
            try:
                out.append(float(tok))
            except ValueError:
                raise RPNError(f"bad token {tok!r}") from None
    return out

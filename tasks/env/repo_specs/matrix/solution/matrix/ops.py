def _shape(a):
    return len(a), len(a[0])


def add(a, b):
    if _shape(a) != _shape(b):
        raise ValueError("shapes differ")
    return [[x + y for x, y in zip(ra, rb, strict=True)] for ra, rb in zip(a, b, strict=True)]


def transpose(a):
    return [list(col) for col in zip(*a, strict=True)]


def identity(n):
    if n < 1:
        raise ValueError("n must be at least 1")
    return [[1 if i == j else 0 for j in range(n)] for i in range(n)]


def mul(a, b):
    if len(a[0]) != len(b):
        raise ValueError("columns of a must equal rows of b")
    cols = transpose(b)
    return [[sum(x * y for x, y in zip(row, col, strict=True)) for col in cols] for row in a]


def det(a):
    n, m = _shape(a)
    if n != m:
        raise ValueError("det needs a square matrix")
    if n == 1:
        return a[0][0]
    total = 0
    for j in range(n):
        minor = [row[:j] + row[j + 1 :] for row in a[1:]]
        total += (-1) ** j * a[0][j] * det(minor)
    return total

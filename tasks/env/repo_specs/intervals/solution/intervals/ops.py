def merge(intervals):
    pairs = []
    for a, b in intervals:
        if a > b:
            raise ValueError(f"start {a} > end {b}")
        pairs.append((a, b))
    pairs.sort()
    out = []
    for a, b in pairs:
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def total_length(intervals):
    return sum(b - a for a, b in merge(intervals))


def contains(intervals, x):
    return any(a <= x <= b for a, b in intervals)


def intersect(a, b):
    a, b = merge(a), merge(b)
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo = max(a[i][0], b[j][0])
        hi = min(a[i][1], b[j][1])
        if lo <= hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out

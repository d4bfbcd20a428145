def _field(value):
    s = str(value)
    if any(c in s for c in ',"\n'):
        return '"' + s.replace('"', '""') + '"'
    return s


def format_line(fields):
    return ",".join(_field(f) for f in fields)


def write(rows, fieldnames):
    lines = [format_line(fieldnames)]
    for row in rows:
        lines.append(format_line(row.get(name, "") for name in fieldnames))
    return "".join(ln + "\n" for ln in lines)

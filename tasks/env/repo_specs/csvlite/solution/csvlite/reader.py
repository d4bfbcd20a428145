def parse_line(line):
    fields, cur, i, quoted = [], [], 0, False
    while i < len(line):
        ch = line[i]
        if quoted:
            if ch == '"':
                if i + 1 < len(line) and line[i + 1] == '"':
                    cur.append('"')
                    i += 1
                else:
                    quoted = False
            else:
                cur.append(ch)
        elif ch == '"':
            quoted = True
        elif ch == ",":
            fields.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
        i += 1
    if quoted:
        raise ValueError("unterminated quote")
    fields.append("".join(cur))
    return fields


def read(text):
    lines = [ln for ln in text.split("\n") if ln != ""]
    if not lines:
        return []
    header = parse_line(lines[0])
    rows = []
    for ln in lines[1:]:
        fields = parse_line(ln)
        if len(fields) != len(header):
            raise ValueError(f"expected {len(header)} fields, got {len(fields)}")
        rows.append(dict(zip(header, fields, strict=True)))
    return rows

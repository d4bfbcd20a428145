def wrap(text, width):
    if width < 1:
        raise ValueError("width must be at least 1")
    lines, cur = [], ""
    for word in text.split():
        if not cur:
            cur = word
        elif len(cur) + 1 + len(word) <= width:
            cur += " " + word
        else:
            lines.append(cur)
            cur = word
    if cur:
        lines.append(cur)
    return lines


def fill(text, width):
    return "\n".join(wrap(text, width))


def _spread(line, width):
    words = line.split(" ")
    gaps = len(words) - 1
    if gaps == 0 or len(line) >= width:
        return line
    extra = width - len(line)
    out = words[0]
    for i, w in enumerate(words[1:]):
        out += " " * (1 + extra // gaps + (1 if i < extra % gaps else 0)) + w
    return out


def justify(text, width):
    lines = wrap(text, width)
    return [_spread(ln, width) for ln in lines[:-1]] + lines[-1:]

from csvlite.reader import parse_line, read
from csvlite.writer import format_line, write

__all__ = ["format_line", "parse_line", "read", "write"]

from matrix.ops import add, det, identity, mul, transpose

__all__ = ["add", "det", "identity", "mul", "transpose"]

from intervals.ops import contains, intersect, merge, total_length

__all__ = ["contains", "intersect", "merge", "total_length"]

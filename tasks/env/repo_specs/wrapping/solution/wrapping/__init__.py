from wrapping.wrap import fill, justify, wrap

__all__ = ["fill", "justify", "wrap"]

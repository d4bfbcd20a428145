from units.convert import UnitError, convert

__all__ = ["UnitError", "convert"]

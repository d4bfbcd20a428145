from graphs.order import CycleError, topo_sort
from graphs.paths import components, shortest_path

__all__ = ["CycleError", "components", "shortest_path", "topo_sort"]

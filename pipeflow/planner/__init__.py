"""The planner: Chinchilla sizing, a memory and time cost model, and the grid search."""

from pipeflow.planner.cost import Estimate, Grid, estimate
from pipeflow.planner.hardware import PRESETS, Cluster, Hardware, LayerTimes, get_hardware
from pipeflow.planner.scaling import (BESIROGLU_FIT, HOFFMANN_FIT, METHODS, Allocation,
                                      allocate, allocate_for_params)
from pipeflow.planner.search import PlanError, SearchOptions, SearchResult, search
from pipeflow.planner.sizing import Sizing, render_table, size_run, to_json, train_toml
from pipeflow.planner.shapes import Shape, shape_for_params

__all__ = [
    "Allocation", "BESIROGLU_FIT", "Cluster", "Estimate", "Grid", "HOFFMANN_FIT", "Hardware",
    "LayerTimes", "METHODS", "PRESETS", "PlanError", "SearchOptions", "SearchResult", "Shape",
    "Sizing", "allocate", "allocate_for_params", "estimate", "get_hardware", "render_table",
    "search", "shape_for_params", "size_run", "to_json", "train_toml",
]

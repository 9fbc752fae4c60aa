"""Schedules as data: the instruction IR (`ir`), one module per schedule and its `ScheduleSpec`
(`spec`), the registry of them (`registry`), the links' message order (`links`), the simulator
(`simulate`), `auto` (choosing one by measured layer costs) and the split backward
(`split_backward`: B and W apart)."""

from pipeflow.schedules.ir import (BACKWARD, COMPUTE, FORWARD, RECV_ACT, RECV_GRAD, RECVS,
                                   SEND_ACT, SEND_GRAD, SENDS, WEIGHT, Action, Layout, Programs,
                                   Route, ScheduleError, route)
from pipeflow.schedules.links import batched_rendezvous_stalls
from pipeflow.schedules.registry import SCHEDULES, build_schedule, get, names, stage_layout
from pipeflow.schedules.simulate import SimResult, format_table, simulate
from pipeflow.schedules.spec import ScheduleSpec

__all__ = ["Action", "FORWARD", "BACKWARD", "WEIGHT", "SEND_ACT", "RECV_ACT", "SEND_GRAD",
           "RECV_GRAD", "COMPUTE", "SENDS", "RECVS", "ScheduleError", "Programs", "Layout",
           "Route", "route", "ScheduleSpec", "SCHEDULES", "get", "names", "build_schedule",
           "stage_layout", "SimResult", "simulate", "format_table", "batched_rendezvous_stalls"]

"""GPU presets and cluster descriptions, every figure with its source."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping, Sequence

__all__ = ["Hardware", "LayerTimes", "Cluster", "PRESETS", "ALIASES", "get_hardware",
           "HardwareError", "fit_relative", "GB", "GiB"]

GB = 1e9
GiB = 2.0 ** 30


class HardwareError(ValueError):
    """An unknown preset or an impossible cluster; the message says what is accepted."""


@dataclasses.dataclass(frozen=True)
class LayerTimes:
    """Measured seconds per micro-batch for each layer kind of one model shape.

    `samples[kind][phase][b]` is the time measured at micro-batch size b; sizes not measured
    come from `times[kind][phase] = (c0, c1)`, the fit t(b) = c0 + c1·b: a fixed cost per call
    (Python, kernel launch) plus a cost per sequence. Kinds are "embed", "block" and "head"
    (the output head with the loss); phases "forward" and "backward". A kind measured cut
    for a tensor group of t ranks (one rank's slices, its collectives left out) is stored
    as "block@t" / "head@t" (`time_at`).
    """

    shape: Mapping[str, int]
    times: Mapping[str, Mapping[str, tuple[float, float]]]
    optimizer_s_per_param: float
    samples: Mapping[str, Mapping[str, Mapping[int, float]]] = dataclasses.field(
        default_factory=dict)

    def time(self, kind: str, phase: str, micro_batch_size: int) -> float:
        measured = self.samples.get(kind, {}).get(phase, {}).get(micro_batch_size)
        if measured is not None:
            return measured
        c0, c1 = self.times[kind][phase]
        return max(0.0, c0 + c1 * micro_batch_size)

    def time_at(self, kind: str, phase: str, micro_batch_size: int, tensor: int = 1) -> float:
        """`time` of one rank's cut of `kind` in a tensor group of `tensor`: measured where
        calibrated ("block@2"), else the whole layer's time over `tensor`."""
        if tensor == 1:
            return self.time(kind, phase, micro_batch_size)
        cut = f"{kind}@{tensor}"
        if cut in self.times:
            return self.time(cut, phase, micro_batch_size)
        return self.time(kind, phase, micro_batch_size) / tensor

    @classmethod
    def from_samples(cls, shape: Mapping[str, int],
                     samples: Mapping[str, Mapping[str, Mapping[int, float]]],
                     optimizer_s_per_param: float) -> "LayerTimes":
        times = {k: {ph: fit_relative(list(v), [v[b] for b in v]) for ph, v in phs.items()}
                 for k, phs in samples.items()}
        return cls(dict(shape), times, optimizer_s_per_param,
                   {k: {ph: dict(v) for ph, v in phs.items()} for k, phs in samples.items()})

    def fastest(self, other: "LayerTimes") -> "LayerTimes":
        """Each sample the faster of the two measurements (disturbances only add time)."""
        merged = {k: {ph: {b: min(t, other.samples.get(k, {}).get(ph, {}).get(b, t))
                           for b, t in v.items()} for ph, v in phs.items()}
                  for k, phs in self.samples.items()}
        return LayerTimes.from_samples(self.shape, merged, min(self.optimizer_s_per_param,
                                                               other.optimizer_s_per_param))

    def to_dict(self) -> dict[str, Any]:
        return {"shape": dict(self.shape),
                "times": {k: {ph: list(v) for ph, v in t.items()} for k, t in self.times.items()},
                "optimizer_s_per_param": self.optimizer_s_per_param,
                "samples": {k: {ph: {str(b): t for b, t in v.items()} for ph, v in phs.items()}
                            for k, phs in self.samples.items()}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "LayerTimes":
        samples = {k: {ph: {int(b): float(t) for b, t in v.items()} for ph, v in phs.items()}
                   for k, phs in d.get("samples", {}).items()}
        return cls(dict(d["shape"]),
                   {k: {ph: tuple(v) for ph, v in t.items()} for k, t in d["times"].items()},
                   float(d["optimizer_s_per_param"]), samples)


def fit_relative(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(c0, c1) of y = c0 + c1·x minimising the squared *relative* errors, so that small
    micro-batches (many of them per step) are fitted as well as large ones."""
    if len(xs) == 1:
        return 0.0, ys[0] / xs[0]
    w = [1.0 / (y * y) if y > 0 else 1.0 for y in ys]
    sw = sum(w)
    mx = sum(wi * x for wi, x in zip(w, xs)) / sw
    my = sum(wi * y for wi, y in zip(w, ys)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, xs))
    c1 = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, xs, ys)) / sxx
    return my - c1 * mx, c1


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One accelerator and the links around it. Bandwidths are bytes/s per GPU per direction."""

    name: str
    peak_flops: float             # dense bf16 FLOP/s (the fp32 engine reaches less; see cost)
    memory_bytes: float
    memory_bandwidth: float       # HBM bytes/s: bounds the optimizer step
    intra_node_bandwidth: float   # NVLink
    inter_node_bandwidth: float   # InfiniBand NIC per GPU
    intra_node_latency: float = 5e-6
    inter_node_latency: float = 10e-6
    # Fraction of peak the layers' matrix multiplies reach. An assumption, not a datasheet
    # figure: Narayanan et al. 2021 measure 52% of A100 peak end to end (bubble and
    # communication included) for GPT-3 175B; layers alone run a little faster.
    efficiency: float = 0.5
    # Fraction of a link's nominal bandwidth collectives reach (NCCL bus bandwidth is
    # typically 75-90% of nominal). An assumption.
    link_efficiency: float = 0.8
    # Kept free for the CUDA context, library workspaces and allocator fragmentation.
    memory_reserve_fraction: float = 0.10
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict)
    layer_times: LayerTimes | None = None   # set by calibration: replaces peak × efficiency
    # The tensor group's all-reduce as calibration measured it (bandwidth and latency of a
    # ring step, so `cost.ring_allreduce_time` gives the measured time); None: the intra-node
    # link's figures.
    tensor_bandwidth: float | None = None
    tensor_latency: float | None = None

    @property
    def usable_memory(self) -> float:
        return self.memory_bytes * (1.0 - self.memory_reserve_fraction)

    @property
    def calibrated(self) -> bool:
        return self.layer_times is not None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["sources"] = dict(self.sources)
        d["layer_times"] = self.layer_times.to_dict() if self.layer_times else None
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Hardware":
        d = dict(d)
        lt = d.get("layer_times")
        d["layer_times"] = LayerTimes.from_dict(lt) if lt else None
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise HardwareError(f"unknown hardware field(s) {unknown}; known: {sorted(known)}")
        return cls(**d)

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Hardware":
        """A hardware file (`pipeflow plan --calibrate --save-hardware FILE`), checked whole:
        a HardwareError naming the file and the field otherwise."""
        path = os.fspath(path)
        redo = ("write it again with `pipeflow plan --calibrate --save-hardware FILE`, or "
                "drop --hardware-file for a --gpu preset")
        try:
            with open(path, "rb") as f:
                record = json.loads(f.read())
        except FileNotFoundError:
            raise HardwareError(f"--hardware-file {path!r}: no such file; {redo}") from None
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            what = "cannot be read" if isinstance(exc, OSError) else \
                "is not JSON (truncated or damaged?)"
            raise HardwareError(f"--hardware-file {path!r} {what} ({exc}); {redo}") from None
        try:
            hardware = cls.from_dict(record)
        except (TypeError, KeyError, ValueError, AttributeError) as exc:
            raise HardwareError(f"--hardware-file {path!r} is not a hardware record "
                                f"({type(exc).__name__}: {exc}); {redo}") from None
        problem = hardware.problem()
        if problem:
            raise HardwareError(f"--hardware-file {path!r}: {problem}; fix that field or {redo}")
        return hardware

    def problem(self) -> str:
        """What is impossible in this description ("" when nothing): a figure <= 0, a
        fraction outside its range, a name that is not text."""
        if not isinstance(self.name, str):
            return f"name must be text, found {self.name!r}"
        for field in ("peak_flops", "memory_bytes", "memory_bandwidth", "intra_node_bandwidth",
                      "inter_node_bandwidth"):
            value = getattr(self, field)
            if not _number(value) or not value > 0:
                return f"{field} must be a finite number > 0, found {value!r}"
        for field in ("tensor_bandwidth", "tensor_latency"):
            value = getattr(self, field)
            if value is not None and (not _number(value) or value < 0
                                      or (field == "tensor_bandwidth" and value == 0)):
                return f"{field} must be null or a finite number > 0, found {value!r}"
        for field in ("intra_node_latency", "inter_node_latency"):
            value = getattr(self, field)
            if not _number(value) or value < 0:
                return f"{field} must be a finite number >= 0, found {value!r}"
        for field in ("efficiency", "link_efficiency"):
            value = getattr(self, field)
            if not _number(value) or not 0 < value <= 1:
                return f"{field} must be a number in (0, 1], found {value!r}"
        reserve = self.memory_reserve_fraction
        if not _number(reserve) or not 0 <= reserve < 1:
            return f"memory_reserve_fraction must be a number in [0, 1), found {reserve!r}"
        return ""


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value)


_A100_SRC = {
    "peak_flops": "NVIDIA A100 datasheet: BF16 Tensor Core 312 TFLOPS dense (624 sparse)",
    "memory": "NVIDIA A100 datasheet: 40 GB HBM2 at 1,555 GB/s; 80 GB HBM2e at 2,039 GB/s (SXM)",
    "intra_node_bandwidth": "NVIDIA A100 datasheet: NVLink 600 GB/s (both directions; "
                            "300 GB/s each way)",
    "inter_node_bandwidth": "NVIDIA DGX A100 datasheet: 8× ConnectX-6 HDR InfiniBand 200 Gb/s, "
                            "one per GPU (25 GB/s each way)",
}
_H100_SRC = {
    "peak_flops": "NVIDIA H100 datasheet (SXM): BF16 Tensor Core 1,979 TFLOPS with sparsity, "
                  "989 dense",
    "memory": "NVIDIA H100 datasheet (SXM): 80 GB HBM3 at 3.35 TB/s",
    "intra_node_bandwidth": "NVIDIA H100 datasheet: NVLink 900 GB/s (both directions; "
                            "450 GB/s each way)",
    "inter_node_bandwidth": "NVIDIA DGX H100 datasheet: 8× ConnectX-7 NDR InfiniBand 400 Gb/s, "
                            "one per GPU (50 GB/s each way)",
}
_H200_SRC = {
    "peak_flops": "NVIDIA H200 datasheet (SXM): BF16 Tensor Core 1,979 TFLOPS with sparsity, "
                  "989 dense",
    "memory": "NVIDIA H200 datasheet (SXM): 141 GB HBM3e at 4.8 TB/s",
    "intra_node_bandwidth": "NVIDIA H200 datasheet: NVLink 900 GB/s (both directions; "
                            "450 GB/s each way)",
    "inter_node_bandwidth": "NVIDIA DGX H200 datasheet: 8× ConnectX-7 NDR InfiniBand 400 Gb/s, "
                            "one per GPU (50 GB/s each way)",
}
_COMMON_SRC = {
    "latency": "assumption: order of NCCL small-message latency, 5 µs NVLink, 10 µs InfiniBand",
    "efficiency": "assumption: 50% of peak; Narayanan et al. 2021 report 52% of A100 peak end "
                  "to end for GPT-3 175B",
    "link_efficiency": "assumption: collectives reach ~80% of nominal link bandwidth",
}

PRESETS: dict[str, Hardware] = {
    "a100-40gb": Hardware("A100 SXM 40GB", 312e12, 40 * GB, 1555 * GB, 300 * GB, 25 * GB,
                          sources=_A100_SRC | _COMMON_SRC),
    "a100-80gb": Hardware("A100 SXM 80GB", 312e12, 80 * GB, 2039 * GB, 300 * GB, 25 * GB,
                          sources=_A100_SRC | _COMMON_SRC),
    "h100": Hardware("H100 SXM 80GB", 989e12, 80 * GB, 3350 * GB, 450 * GB, 50 * GB,
                     sources=_H100_SRC | _COMMON_SRC),
    "h200": Hardware("H200 SXM 141GB", 989e12, 141 * GB, 4800 * GB, 450 * GB, 50 * GB,
                     sources=_H200_SRC | _COMMON_SRC),
}
ALIASES = {"a100": "a100-80gb", "a100-40": "a100-40gb", "a100-80": "a100-80gb",
           "h100-sxm": "h100", "h100-80gb": "h100", "h200-sxm": "h200", "h200-141gb": "h200"}


def get_hardware(name: str) -> Hardware:
    key = name.lower()
    key = ALIASES.get(key, key)
    if key not in PRESETS:
        raise HardwareError(f"unknown GPU {name!r}; presets are {sorted(PRESETS)} "
                            f"(aliases {sorted(ALIASES)}), or calibrate this machine with "
                            f"--calibrate / load one with --hardware-file")
    return PRESETS[key]


@dataclasses.dataclass(frozen=True)
class Cluster:
    """`gpus` accelerators of one kind, `gpus_per_node` to a node.

    Ranks fill nodes in order, and the grid places a stage's data-parallel replicas on
    consecutive ranks (`pipeflow.grid.Grid`), as Megatron-LM does: the all-reduce
    stays inside a node as long as the data group does, and the pipeline's point-to-point
    traffic crosses nodes.
    """

    hardware: Hardware
    gpus: int
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        if not isinstance(self.gpus, int) or isinstance(self.gpus, bool) or self.gpus < 1:
            raise HardwareError(f"--gpus must be a positive integer, found {self.gpus!r}; a "
                                f"plan needs at least one GPU")
        if (not isinstance(self.gpus_per_node, int) or isinstance(self.gpus_per_node, bool)
                or self.gpus_per_node < 1):
            raise HardwareError(f"--gpus-per-node must be a positive integer, found "
                                f"{self.gpus_per_node!r}; give the GPUs a node holds "
                                f"(e.g. --gpus-per-node 8), or leave it out for min(8, --gpus)")

    def node(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def same_node(self, ranks: list[int]) -> bool:
        # Nodes hold neighbouring ranks: all share one iff the lowest and highest do.
        return not ranks or self.node(min(ranks)) == self.node(max(ranks))

    def link(self, ranks: list[int]) -> tuple[float, float]:
        """(bandwidth, latency) of the slowest link joining `ranks`, efficiency applied."""
        hw = self.hardware
        if self.same_node(ranks):
            return hw.intra_node_bandwidth * hw.link_efficiency, hw.intra_node_latency
        return hw.inter_node_bandwidth * hw.link_efficiency, hw.inter_node_latency

    def tensor_link(self, tensor: int) -> tuple[float, float]:
        """(bandwidth, latency) of a ring step of a tensor group of `tensor` consecutive ranks
        (one node: the search keeps t within `gpus_per_node`): measured by calibration where
        it was, else the intra-node link's."""
        hw = self.hardware
        if hw.tensor_bandwidth is not None:
            return hw.tensor_bandwidth, hw.tensor_latency or 0.0
        return self.link(list(range(tensor)))

"""Chinchilla scaling: the compute-optimal parameter and token counts for a FLOP budget."""

from __future__ import annotations

import dataclasses
import math

__all__ = [
    "TABLE3", "APPROACH1_A", "APPROACH1_B", "APPROACH1_G", "ParametricFit", "HOFFMANN_FIT",
    "BESIROGLU_FIT", "METHODS", "Allocation", "ScalingError", "training_flops", "allocate",
    "allocate_for_params", "compute_from_gpu_days", "SECONDS_PER_DAY",
]

SECONDS_PER_DAY = 86_400.0


class ScalingError(ValueError):
    """A budget or model size the scaling laws cannot answer; the message says what to change."""


# Hoffmann et al. 2022, "Training Compute-Optimal Large Language Models", Table 3: the
# approach-1 (isoFLOP envelope) projection of the optimal budget and tokens per model size.
# (parameters, training FLOPs, training tokens)
TABLE3: tuple[tuple[float, float, float], ...] = (
    (400e6, 1.92e19, 8.0e9),
    (1e9, 1.21e20, 20.2e9),
    (10e9, 1.23e22, 205.1e9),
    (67e9, 5.76e23, 1.5e12),
    (175e9, 3.85e24, 3.7e12),
    (280e9, 9.90e24, 5.9e12),
    (520e9, 3.43e25, 11.0e12),
    (1e12, 1.27e26, 21.2e12),
    (10e12, 1.30e28, 216.2e12),
)

# Approach 1's exponents (Hoffmann et al. 2022, Table 2): N_opt ∝ C^a, D_opt ∝ C^b.
APPROACH1_A = 0.50
APPROACH1_B = 0.50


def _fit_approach1_coefficient() -> float:
    """G in N_opt = G·C^a: the least-squares fit (in log space) of Table 3 at the paper's a.

    The paper publishes the exponents and the table, not the coefficient; fitting the one
    free number to the table keeps every row within a few percent (see tests).
    """
    logs = [math.log(n) - APPROACH1_A * math.log(c) for n, c, _ in TABLE3]
    return math.exp(sum(logs) / len(logs))


APPROACH1_G = _fit_approach1_coefficient()   # ≈ 0.0893: N_opt ≈ 0.0893·√C, D ≈ 20.5·N_opt


def training_flops(params: float, tokens: float) -> float:
    """Training compute C ≈ 6·N·D (Kaplan et al. 2020; Hoffmann et al. 2022, section 3)."""
    return 6.0 * params * tokens


@dataclasses.dataclass(frozen=True)
class ParametricFit:
    """The parametric loss L(N, D) = E + A/N^α + B/D^β and its compute-optimal frontier."""

    name: str
    E: float
    A: float
    B: float
    alpha: float
    beta: float
    source: str

    def loss(self, params: float, tokens: float) -> float:
        return self.E + self.A / params ** self.alpha + self.B / tokens ** self.beta

    @property
    def G(self) -> float:
        # Hoffmann et al. 2022, eq. (4): G = (αA / βB)^(1/(α+β)).
        return (self.alpha * self.A / (self.beta * self.B)) ** (1.0 / (self.alpha + self.beta))

    @property
    def a(self) -> float:
        return self.beta / (self.alpha + self.beta)

    @property
    def b(self) -> float:
        return self.alpha / (self.alpha + self.beta)

    def optimum(self, compute: float) -> tuple[float, float]:
        """(N_opt, D_opt) minimising L under 6·N·D = C: G·(C/6)^a and G⁻¹·(C/6)^b."""
        return self.G * (compute / 6.0) ** self.a, (compute / 6.0) ** self.b / self.G

    def compute_for_params(self, params: float) -> float:
        """The budget C whose optimum N_opt is `params` (the frontier inverted)."""
        return 6.0 * (params / self.G) ** (1.0 / self.a)


HOFFMANN_FIT = ParametricFit(
    "Hoffmann et al. 2022 parametric fit", E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28,
    source="Hoffmann et al. 2022, eq. (10) / section 3.3")
BESIROGLU_FIT = ParametricFit(
    "Besiroglu et al. 2024 parametric fit", E=1.8172, A=482.01, B=2085.43,
    alpha=0.3478, beta=0.3658,
    source="Besiroglu et al. 2024, 'Chinchilla Scaling: A replication attempt', eq. (2)")

# Method name -> (how N and D are allocated, which loss fit predicts the loss).
METHODS: dict[str, str] = {
    "hoffmann": "Hoffmann et al. 2022 approach 1 (isoFLOP envelope, N ∝ C^0.50, D ∝ C^0.50, "
                "coefficient fitted to Table 3); loss from their parametric fit",
    "parametric": "Hoffmann et al. 2022 approach 3 (parametric fit E=1.69, A=406.4, B=410.7, "
                  "α=0.34, β=0.28)",
    "besiroglu": "Besiroglu et al. 2024 corrected parametric fit (E=1.8172, A=482.01, "
                 "B=2085.43, α=0.3478, β=0.3658)",
}


def _loss_fit(method: str) -> ParametricFit:
    return BESIROGLU_FIT if method == "besiroglu" else HOFFMANN_FIT


def _check_method(method: str) -> None:
    if method not in METHODS:
        raise ScalingError(f"unknown scaling method {method!r}; expected one of {list(METHODS)}")


@dataclasses.dataclass(frozen=True)
class Allocation:
    """A training budget split into parameters and tokens, with the loss the fit predicts."""

    method: str
    compute: float        # FLOPs, 6·N·D
    params: float         # N
    tokens: float         # D
    loss: float           # predicted final training loss (nats/token)
    description: str
    loss_fit: str

    @property
    def tokens_per_param(self) -> float:
        return self.tokens / self.params

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"tokens_per_param": self.tokens_per_param}


def _optimal_params(compute: float, method: str) -> float:
    if method == "hoffmann":
        return APPROACH1_G * compute ** APPROACH1_A
    return _loss_fit(method).optimum(compute)[0]


def allocate(compute: float, method: str = "hoffmann") -> Allocation:
    """The compute-optimal (N, D) for a budget of `compute` FLOPs, with C = 6·N·D."""
    _check_method(method)
    if not (isinstance(compute, (int, float)) and math.isfinite(compute) and compute > 0):
        raise ScalingError(f"the compute budget must be a positive number of FLOPs, "
                           f"found {compute!r}")
    params = _optimal_params(compute, method)
    tokens = compute / (6.0 * params)
    fit = _loss_fit(method)
    return Allocation(method, compute, params, tokens, fit.loss(params, tokens),
                      METHODS[method], fit.name)


def allocate_for_params(params: float, method: str = "hoffmann",
                        compute: float | None = None) -> Allocation:
    """Tokens for a model of `params` parameters: D = C/(6N) for a given budget `compute`,
    else the budget for which `params` is compute-optimal (about 20 tokens per parameter)."""
    _check_method(method)
    if not params > 0:
        raise ScalingError(f"the parameter count must be positive, found {params!r}")
    if compute is None:
        if method == "hoffmann":
            compute = (params / APPROACH1_G) ** (1.0 / APPROACH1_A)
        else:
            compute = _loss_fit(method).compute_for_params(params)
    tokens = compute / (6.0 * params)
    fit = _loss_fit(method)
    return Allocation(method, compute, params, tokens, fit.loss(params, tokens),
                      METHODS[method], fit.name)


def compute_from_gpu_days(gpus: int, days: float, peak_flops: float, mfu: float) -> float:
    """C = GPUs × seconds × peak FLOP/s × model FLOPs utilisation."""
    if not (isinstance(gpus, int) and gpus > 0):
        raise ScalingError(f"--gpus must be a positive integer, found {gpus!r}")
    if not days > 0:
        raise ScalingError(f"--days must be positive, found {days!r}")
    if not 0 < mfu <= 1:
        raise ScalingError(f"the model FLOPs utilisation must be in (0, 1], found {mfu!r}")
    return gpus * days * SECONDS_PER_DAY * peak_flops * mfu

"""The measured rates the cost model runs on: a ``Calibration`` per (device
type, group, head dim), measured by a short microbenchmark
(cplib/strategy/microbench.py), given by the user, or one of the built-in
defaults below.

Built-in defaults (``DEFAULTS``), and where their figures come from:

* ``"h100"``: one H100 SXM node, NVLink between its GPUs and InfiniBand NDR
  between nodes.
  - Attention: this project's H100 log (``shared/gpu-runs/2026-11-25-h100/
    bench_8f34048_aten_abi.json``): full causal SDPA fwd+bwd, B=1 H=16
    S=32768 D=128 bf16, flash 46.77 ms (8.6e9 visible pairs x (D + Dv) =
    2.2e12 units: 2.13e-14 s per unit, 329 TFLOP/s at 3.5 x 4·D FLOPs per
    pair). cuDNN ran the same in 27.27 ms; flash is what SDPA picks first on
    torch 2.11, so it is the default.
  - NVLink 4: 900 GB/s per GPU both directions together (NVIDIA H100
    datasheet), 450 GB/s each way; 80 % of it (360 GB/s) as the rate an
    all-to-all reaches (the figure the hand-made crossover table of earlier RESULTS.md used).
  - InfiniBand NDR: one 400 Gb/s ConnectX-7 per GPU = 50 GB/s each way
    (NVIDIA DGX H100 user guide); 90 % of it (45 GB/s).
  - HBM3: 3.35 TB/s (datasheet); 2.6 TB/s for a copy's read + write.
  - Masks: a masked kernel at 2.5x the unmasked one per unit (an estimate:
    cplib's CUDA tiles run the memory-efficient kernel with a bias), a mask
    built in about 6 passes of 5 bytes per element at the copy rate, twice.
  - Fixed costs: 20 us per collective (an NCCL launch plus cplib's Python
    op round trip), 40 us per fwd+bwd pair of kernel calls (the route costs
    of RESULTS.md's "CUDA glue" section, on the host); overlap 0.9 (NCCL
    copies on their own channels; the ring posts step s+1 before step s
    computes).
* ``"cpu"``: the 2-core development machine (gloo over loopback), for
  traces and meta tensors where nothing can be measured; from
  RESULTS.md's CPU runs (causal S=8192 H=8 D=64 fp32 fwd+bwd in 3.2 s: 5.7e-11
  s per unit) and the handshake section (about 200 us per gloo collective).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Mapping

__all__ = ["Calibration", "DEFAULTS", "default_for", "as_calibration"]


@dataclass(frozen=True)
class Calibration:
    """Rates of one device type and group.

    ``unit_s``: seconds of a fwd+bwd kernel per unit of work, one query-key
    cell the kernel computes times (D + Dv) (so 3.5 x 4·D FLOPs for D = Dv;
    a causal call computes its visible pairs and the rest of the key blocks
    they touch: cplib/strategy/kernels.py);
    ``masked_unit_s``: the same for a kernel given an explicit mask, per unit
    of the area it computes (per head); ``mask_s``: seconds of building that
    mask, per element (once per call, forward and backward); ``call_s``:
    fixed seconds per fwd+bwd pair of kernel calls (host work, launch,
    small-block inefficiency); ``copy_bps``: bytes per second of a pass over
    memory (merges, packing), read + write counted; ``latency_s``: fixed
    seconds per collective; ``link_bps``: bytes per second one rank sends
    inside a node; ``inter_node_bps``: the same across nodes;
    ``reduce_scatter_bps``: bytes per second of a reduce-scatter's input and
    ``reduce_scatter_s`` its fixed seconds (gloo's is several times an
    all-to-all's); ``overlap``: the fraction of a ring step's exchange the
    step's compute hides (0 on CPU, where gloo's copies need the same
    cores); ``fwd_fraction``: a forward's share of a fwd+bwd kernel, for
    forward-only calls; ``cores``: how many of a node's ranks compute at
    full speed at once (on CPU, the cores the ranks share, less what other
    jobs take; 0: every rank, each on its own device). On CPU the kernel and
    copy rates are per CPU second of one rank."""

    name: str
    unit_s: float
    masked_unit_s: float
    mask_s: float
    call_s: float
    copy_bps: float
    latency_s: float
    link_bps: float
    inter_node_bps: float
    reduce_scatter_bps: float
    reduce_scatter_s: float
    overlap: float
    fwd_fraction: float = 0.3
    cores: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name == "name":
                continue
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or \
                    not value >= 0 or value == float("inf"):
                raise ValueError(f"cplib.strategy: Calibration.{f.name}={value!r} must be a "
                                 "finite number >= 0")
        for name in ("link_bps", "inter_node_bps", "reduce_scatter_bps", "copy_bps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"cplib.strategy: Calibration.{name} must be > 0")
        if not 0 <= self.overlap <= 1 or not 0 < self.fwd_fraction <= 1:
            raise ValueError("cplib.strategy: Calibration.overlap must be in [0, 1] and "
                             "fwd_fraction in (0, 1]")

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


_H100_UNIT = 46.77e-3 / (16 * 32768 * 32769 / 2 * 256)

DEFAULTS: dict[str, Calibration] = {
    "h100": Calibration("h100 (NVLink node, InfiniBand NDR between nodes)",
                        unit_s=_H100_UNIT, masked_unit_s=2.5 * _H100_UNIT, mask_s=2.5e-11,
                        call_s=40e-6,
                        copy_bps=2.6e12, latency_s=20e-6, link_bps=360e9,
                        inter_node_bps=45e9, reduce_scatter_bps=360e9, reduce_scatter_s=20e-6,
                        overlap=0.9),
    "cpu": Calibration("cpu (2-core development machine, gloo loopback)",
                       unit_s=3.2 / (8 * 8192 * 8193 / 2 * 128), masked_unit_s=1.2e-10,
                       mask_s=2e-9,
                       call_s=300e-6, copy_bps=8e9, latency_s=200e-6, link_bps=1.5e9,
                       inter_node_bps=1.5e9, reduce_scatter_bps=0.5e9, reduce_scatter_s=1e-3,
                       overlap=0.0, cores=2.0),
}


def default_for(device_type: str) -> Calibration:
    """The built-in default of a device type (CUDA: "h100"; else "cpu")."""
    return DEFAULTS["h100" if device_type == "cuda" else "cpu"]


def as_calibration(value: "Calibration | str | Mapping[str, float]",
                   device_type: str = "cpu") -> Calibration:
    """A Calibration from what a user may give: one, the name of a built-in
    default, or a mapping of field overrides on the device's default (e.g.
    ``{"link_bps": 100e9}``). ValueError names anything else."""
    if isinstance(value, Calibration):
        return value
    if isinstance(value, str):
        if value not in DEFAULTS:
            raise ValueError(f"cplib.strategy: calibration={value!r} is not one of "
                             f"{sorted(DEFAULTS)} (or a Calibration, or a dict of overrides)")
        return DEFAULTS[value]
    if isinstance(value, Mapping):
        known = {f.name for f in fields(Calibration)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"cplib.strategy: unknown calibration fields {unknown}; known: "
                             f"{sorted(known)}")
        return replace(default_for(device_type), name="user", **dict(value))
    raise ValueError(f"cplib.strategy: calibration must be a Calibration, a name in "
                     f"{sorted(DEFAULTS)} or a dict of overrides, got {type(value).__name__}")

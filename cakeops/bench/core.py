"""The benchmark case record, its registry, and the measurements made of each case.

A case is one op at one shape. It builds its own random inputs (``make``), runs the cakeops op
(``run``), declares the minimal bytes the op must move (``nbytes``: every required tensor read once,
every output written once), names peers doing the same work, and compares the op with an fp64
oracle (``check``). Nothing here knows any particular op.
"""
import importlib
import inspect
import pkgutil
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import torch

State = Any  # whatever a case's make() returns; only the case's own callables look inside


@dataclass(frozen=True)
class Case:
    family: str  # the --ops name, e.g. "rmsnorm"
    name: str  # the table's op column, e.g. "rmsnorm fwd"
    size: Mapping[str, int]  # the benchmark shape, e.g. {"T": 32768, "H": 4096}
    make: Callable[[torch.device, torch.dtype, Mapping[str, int]], State]
    run: Callable[[State], Any]
    nbytes: Callable[[State], int]
    check: Callable[[State], Mapping[str, float]]  # output name -> relative error vs the oracle
    tol: Mapping[str, float]  # output name -> largest acceptable relative error (design.md §3)
    peers: Mapping[str, Callable[[State], Any]] = field(default_factory=dict)
    tiny: Mapping[str, int] = field(default_factory=lambda: {"T": 64, "H": 384})  # the CPU check's size
    dtype: torch.dtype = torch.bfloat16
    quick: bool = True  # part of `bench --quick`
    notes: Optional[Callable[[State], Mapping[str, str]]] = None  # extra measurements, printed under the table

    @property
    def shape_label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.size.items())


_REGISTRY: List[Case] = []


def register(*new: Case) -> None:
    _REGISTRY.extend(new)


def load_families() -> None:
    """Import every ``*_cases`` module of this package; importing one registers its cases."""
    package = importlib.import_module(__package__)
    for info in pkgutil.iter_modules(package.__path__):
        if info.name.endswith("_cases"):
            importlib.import_module(f"{__package__}.{info.name}")


def families() -> List[str]:
    return list(dict.fromkeys(c.family for c in _REGISTRY))


def cases(only: Optional[Sequence[str]] = None, quick: bool = False) -> List[Case]:
    return [c for c in _REGISTRY if (only is None or c.family in only) and (c.quick or not quick)]


def generator(device, *key) -> torch.Generator:
    """A generator seeded from the case's identity: every case and shape draws its own inputs."""
    gen = torch.Generator(device=device)
    gen.manual_seed(zlib.crc32(repr(key).encode()))
    return gen


def within(errors: Mapping[str, float], tol: Mapping[str, float]) -> bool:
    # NaN compares False, so a NaN error fails as it should.
    return all(err <= tol[name] for name, err in errors.items())


def median_ms(fn: Callable[[], Any]) -> float:
    """Median time of ``fn`` in ms by triton's do_bench (CUDA events, L2 flushed before each call)."""
    from triton.testing import do_bench

    if "return_mode" in inspect.signature(do_bench).parameters:
        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    # Older triton: the median as the 0.5 quantile (a bare float or a one-element list).
    q = do_bench(fn, warmup=25, rep=100, quantiles=[0.5])
    return float(q[0] if isinstance(q, (list, tuple)) else q)


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / ms / 1e6


def copy_gbps(device, gib: int = 2) -> float:
    """The device's practical bandwidth ceiling: a large device-to-device bf16 copy, read + write bytes."""
    src = torch.randn(gib << 29, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return gbps(2 * src.nbytes, median_ms(lambda: dst.copy_(src)))


def _time_peer(case: Case, name: str, state: State, warn: Callable[[str], None]) -> Optional[float]:
    peer = case.peers[name]
    try:
        peer(state)  # a first call outside the timing: torch.compile compiles here, errors surface here
        return median_ms(lambda: peer(state))
    except Exception as exc:  # a failing peer must not take the whole bench down
        warn(f"{case.name} [{case.shape_label}]: peer {name!r} failed: {type(exc).__name__}: {exc}")
        return None


def measure(case: Case, device, ceiling_gbps: float, with_peers: bool = True,
            warn: Callable[[str], None] = print) -> Dict[str, Any]:
    """One row of the bench: the op's time, bandwidth, share of the copy ceiling, error, and the peers' times."""
    state = case.make(device, case.dtype, case.size)
    errors = dict(case.check(state))
    nbytes = int(case.nbytes(state))
    ms = median_ms(lambda: case.run(state))
    peers = {name: _time_peer(case, name, state, warn) for name in case.peers} if with_peers else {}
    return {
        "family": case.family, "op": case.name, "shape": case.shape_label, "dtype": _dtype_name(case.dtype),
        "bytes": nbytes, "ms": ms, "gbps": gbps(nbytes, ms), "pct_copy": 100.0 * gbps(nbytes, ms) / ceiling_gbps,
        "peers_ms": peers, "rel_err": errors, "tol": dict(case.tol), "ok": within(errors, case.tol),
        "notes": dict(case.notes(state)) if case.notes is not None else {},
    }


def cpu_check(case: Case, path: str, tol_scale: float = 1.0) -> Dict[str, Any]:
    """The op at the case's tiny size on CPU (reference path or Triton interpreter) against its oracle.

    ``tol_scale`` widens the tolerances: the Triton interpreter truncates fp32 -> bf16 where a GPU rounds
    to nearest, which doubles the rounding error of every bf16 output.
    """
    state = case.make(torch.device("cpu"), case.dtype, case.tiny)
    errors = dict(case.check(state))
    tol = {name: bound * tol_scale for name, bound in case.tol.items()}
    return {
        "family": case.family, "op": case.name, "shape": " ".join(f"{k}={v}" for k, v in case.tiny.items()),
        "dtype": _dtype_name(case.dtype), "path": path,
        "rel_err": errors, "tol": tol, "ok": within(errors, tol),
    }


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def host_time_per_call(runs: Mapping[str, Callable[[], Any]], calls: int, reps: int, on_gpu: bool,
                       clock: Callable[[], float], unit: float) -> Dict[str, List[float]]:
    """Host time per call in ``unit``s of a second (1e3: ms), read from ``clock``: one list of ``reps`` values
    per path, the paths alternating rep by rep (a shared host's speed drifts). Each path runs 3 times first
    (compile, caches, allocator warm). On a GPU each rep keeps the device busy (``torch.cuda._sleep``) while the
    ``calls`` calls are issued, so the clock measures issuing only. Compiled paths compile with Inductor's caches
    off: its on-disk cache knows a graph's cakeops ops by name only, so a graph cached by another cakeops version
    would be what is measured (seen on a CPU: a cached graph that called the checked ops, not the unchecked twins)."""
    import torch._inductor.config

    with torch._inductor.config.patch(force_disable_caches=True):
        for run in runs.values():
            for _ in range(3):
                run()
    if on_gpu:
        torch.cuda.synchronize()
    times: Dict[str, List[float]] = {name: [] for name in runs}
    for _ in range(reps):
        for name, run in runs.items():
            if on_gpu:
                torch.cuda._sleep(50_000_000 * max(1, calls // 10))  # the GPU stays busy: only issuing is timed
            start = clock()
            for _ in range(calls):
                run()
            times[name].append((clock() - start) / calls * unit)
            if on_gpu:
                torch.cuda.synchronize()
    return times


def self_time_us(event, on_gpu: bool) -> float:
    """A torch.profiler event's own time in us: on the device (``on_gpu``), else on the CPU. (The attribute names
    moved between torch releases: cuda_* -> device_*.)"""
    if on_gpu:
        for name in ("self_device_time_total", "self_cuda_time_total"):
            if hasattr(event, name):
                return float(getattr(event, name))
        return 0.0
    return float(event.self_cpu_time_total)


def kernel_times_us(call, reps: int = 5) -> Dict[str, float]:
    """GPU time per call of each kernel ``call`` launches (torch.profiler, device activity only), by name."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            call()
        torch.cuda.synchronize()
    times = {e.key: self_time_us(e, True) / reps for e in prof.key_averages()}
    return {name: us for name, us in sorted(times.items(), key=lambda kv: -kv[1]) if us > 0}

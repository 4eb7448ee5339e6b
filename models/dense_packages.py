"""Narsil's pooled dense networks compiled ahead of time: AOTInductor
packages (`.pt2`, FP32 and bf16) for this CPU's vector ISA, each Inductor
setting compiled, checked against the network and timed, the fastest kept;
the CPU flags a package needs; the TorchScript and package forms timed on
this CPU for `--dense-form auto` (the schema's `dense_form_timings`).
Used by the split exports (`split_model.py`, `user_once.py`,
`extract_split.py`, `sequence_split.py`)."""

import copy
import os
import time
from pathlib import Path
from typing import List, Tuple

import torch
from torch import nn


# /proc/cpuinfo's name for each x86 compiler flag Inductor's vector ISAs
# compile with (cpu_vec_isa.py's build_arch_flags); a package records the
# CPU flags its kernels need, read from the flags it was compiled with.
GCC_FLAG_CPU_FLAGS = {
    "-mavx2": "avx2", "-mfma": "fma", "-mf16c": "f16c",
    "-mavx512f": "avx512f", "-mavx512dq": "avx512dq", "-mavx512vl": "avx512vl", "-mavx512bw": "avx512bw",
    "-mavx512vnni": "avx512_vnni", "-mavx512bf16": "avx512_bf16", "-mavx512fp16": "avx512_fp16",
    "-mamx-tile": "amx_tile", "-mamx-bf16": "amx_bf16", "-mamx-int8": "amx_int8", "-mamx-fp16": "amx_fp16",
}


def isa_cpu_flags(arch_flags: str) -> List[str]:
    """The /proc/cpuinfo flags a package compiled with `arch_flags` (an
    Inductor vector ISA's compiler flags) needs, in order, once each."""
    flags = []
    for gcc_flag in arch_flags.split():
        cpu_flag = GCC_FLAG_CPU_FLAGS.get(gcc_flag)
        if cpu_flag is None:
            raise SystemExit(f"dense.pt2: no known CPU flag for Inductor's compiler flag {gcc_flag!r} "
                             f"(in {arch_flags!r}); add it to dense_packages.GCC_FLAG_CPU_FLAGS")
        if cpu_flag not in flags:
            flags.append(cpu_flag)
    return flags


# Inductor settings a package is compiled with, each measured at export on
# the exporting CPU; the fastest is kept. Freezing (weights folded as
# constants, GEMMs on prepacked oneDNN weights) measured 0.87-0.93x the
# defaults' speed on an AVX2 Zen 3 and 1.1-1.8x on an AVX-512 Zen 5
# (REPORTS.md#aotinductor-dense-networks); max-autotune's C++ GEMM template
# tunes for the export example's rows and lost 2x at 1,600 rows.
PACKAGE_SETTINGS = {"Inductor defaults": {}, "freezing": {"freezing": True}}
# Bound of a bf16 package's scores from the FP32 network's (as Narsil's bf16).
BF16_PACKAGE_BOUND = 5e-3


def cpu_flags() -> List[str]:
    """This CPU's /proc/cpuinfo flags (none where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []


def cpu_has_bf16() -> bool:
    """Whether this CPU has the bf16 instructions Narsil's bf16 needs."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def package_precisions() -> List[str]:
    """The precisions packages are compiled in here: FP32, and bf16 where
    this CPU has bf16 instructions."""
    return ["fp32", "bf16"] if cpu_has_bf16() else ["fp32"]


def cpu_identity() -> str:
    """This CPU as `vendor family F model M` (from /proc/cpuinfo): what a
    form's timings at export hold for (Narsil reads the same fields: the
    model name alone says "AMD EPYC" for Zen 3, 4 and 5 alike)."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return f"{fields.get('vendor_id', '?')} family {fields.get('cpu family', '?')} model {fields.get('model', '?')}"


def forward_ms(package, inputs, warmups: int = 1) -> float:
    """The fastest of a few timed forwards of `package` on one thread (after
    `warmups` untimed ones: TorchScript profiles its first runs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            for _ in range(warmups):
                package(*inputs)
            best = float("inf")
            for _ in range(5):
                started = time.perf_counter()
                package(*inputs)
                best = min(best, time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads)
    return best * 1e3


def load_unlinked_package(path: str):
    """Loads a package compiled without linking libtorch (its kernels find
    libtorch's symbols in the process, as in Narsil, where libtorch_cpu is
    loaded at start): libtorch_cpu is made global here first."""
    import ctypes
    from torch._inductor import aoti_load_package

    ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"), mode=ctypes.RTLD_GLOBAL)
    return aoti_load_package(path)


TIMED_ROWS = (100, 1600)


def torchscript_ms(out: Path, num_dense: int, pooled_width: int, dtype) -> List[float]:
    """`out/dense.pt` (the TorchScript dense network) timed as Narsil runs
    it (frozen; bf16: floating-point parameters and inputs cast) at
    TIMED_ROWS on one thread."""
    module = torch.jit.load(str(out / "dense.pt")).eval()
    if dtype != torch.float32:
        module = module.to(dtype)
    frozen = torch.jit.freeze(module)
    return [forward_ms(frozen, (torch.randn(rows, num_dense, dtype=dtype), torch.rand(rows, pooled_width, dtype=dtype)),
                       warmups=3) for rows in TIMED_ROWS]


def form_timings(out: Path, num_dense: int, pooled_width: int, precision: str, pt2_ms: List[float], log) -> dict:
    """The schema's record of both forms of one precision timed on this CPU
    at TIMED_ROWS (microseconds), which `--dense-form auto` reads to serve
    the faster where it runs on the same CPU; empty if TorchScript cannot
    be timed in this precision."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    try:
        ts_ms = torchscript_ms(out, num_dense, pooled_width, dtype)
    except Exception as e:  # a network that does not run in bf16 as TorchScript: the package only
        log(f"dense.pt not timed in {precision} ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
        return {}
    per_sample = lambda ms: sum(m / rows for m, rows in zip(ms, TIMED_ROWS))
    faster = "TorchScript" if per_sample(ts_ms) < per_sample(pt2_ms) else ".pt2"
    log(f"{precision} forms on this CPU ({cpu_identity()}), one thread, {TIMED_ROWS[0]} / {TIMED_ROWS[1]:,} rows: "
        f"TorchScript {ts_ms[0]:.2f} / {ts_ms[1]:.1f} ms, .pt2 {pt2_ms[0]:.2f} / {pt2_ms[1]:.1f} ms: "
        f"--dense-form auto serves {faster} here")
    return {"torchscript_us": [round(m * 1e3) for m in ts_ms], "pt2_us": [round(m * 1e3) for m in pt2_ms]}


def sequence_form_timings(out: Path, package, batches: List[Tuple[tuple, int]], log,
                          precision: str = "fp32") -> dict:
    """The schema's `dense_form_timings` for a sequence model's forms of
    one precision: `out/dense.pt` (frozen, as Narsil runs it; bf16: its
    floating-point parameters cast) and `package` (its loaded `.pt2` of
    that precision) timed on one thread on `batches` (each its FP32 inputs,
    cast to the precision, and its rows), which `--dense-form auto` reads to
    serve the faster where it runs on the same CPU (a sequence network's
    TorchScript form can beat its package: GR's attends unit by unit only
    under TorchScript). Timings of several precisions merge into one dict
    (`dict.update`)."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    module = torch.jit.load(str(out / "dense.pt")).eval()
    if dtype != torch.float32:
        module = module.to(dtype)
    try:
        module = torch.jit.freeze(module)
    except Exception:  # a network freezing refuses runs unfrozen, as Narsil then runs it
        pass
    cast = [tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs) for inputs, _ in batches]
    ts_ms = [forward_ms(module, inputs, warmups=3) for inputs in cast]
    pt2_ms = [forward_ms(package, inputs) for inputs in cast]
    rows = [rows for _, rows in batches]
    per_row = lambda ms: sum(m / r for m, r in zip(ms, rows))  # noqa: E731
    faster = "TorchScript" if per_row(ts_ms) < per_row(pt2_ms) else ".pt2"
    log(f"{precision} forms on this CPU ({cpu_identity()}), one thread, batches of {' / '.join(map(str, rows))} "
        f"rows: TorchScript {' / '.join(f'{m:.1f}' for m in ts_ms)} ms, .pt2 {' / '.join(f'{m:.1f}' for m in pt2_ms)} "
        f"ms: --dense-form auto serves {faster} here")
    return {"cpu": cpu_identity(), "rows": rows,
            precision: {"torchscript_us": [round(m * 1e3) for m in ts_ms], "pt2_us": [round(m * 1e3) for m in pt2_ms]}}


def write_dense_package(out: Path, dense_network: nn.Module, num_dense: int, pooled_width: int, log,
                        precision: str = "fp32", stem: str = "dense") -> Tuple[str, List[float]]:
    """Compiles `dense_network` (forward(dense, pooled) -> scores, FP32) with
    torch.export (a dynamic row dimension) and AOTInductor into
    `out/dense.pt2` (FP32) or, for `precision` "bf16", `out/dense_bf16.pt2`
    (weights and inputs bf16, scores FP32), checked at 1, 7 and 100 rows and
    timed at TIMED_ROWS (compile_package). Returns the file's name and the
    kept package's times at TIMED_ROWS (ms)."""
    rows = torch.export.Dim("rows", min=1, max=1 << 20)
    return compile_package(
        out, stem, dense_network, precision, log,
        example=(torch.randn(8, num_dense), torch.randn(8, pooled_width)),
        dynamic_shapes=({0: rows}, {0: rows}),
        checked=[(torch.randn(batch, num_dense), torch.rand(batch, pooled_width)) for batch in (1, 7, 100)],
        timed=[(torch.randn(batch, num_dense), torch.rand(batch, pooled_width)) for batch in TIMED_ROWS])


def compile_package(out: Path, stem: str, network: nn.Module, precision: str, log, example: tuple,
                    dynamic_shapes: tuple, checked: List[tuple], timed: List[tuple]) -> Tuple[str, List[float]]:
    """Compiles `network` (FP32 weights; its floating-point inputs cast to
    its dtype, scores FP32) with torch.export (`dynamic_shapes` over
    `example`) and AOTInductor into `out/{stem}.pt2` (FP32) or, for
    `precision` "bf16", `out/{stem}_bf16.pt2` (weights and inputs bf16).
    Each of PACKAGE_SETTINGS is compiled, checked against `network` in FP32
    on `checked` (FP32: within 1e-5; bf16: within BF16_PACKAGE_BOUND) and
    timed on `timed` (one input tuple per TIMED_ROWS) on one thread; the
    fastest is kept. The package is compiled for this CPU's vector ISA
    without -march=native (so it runs on any CPU with that ISA) and records
    the CPU flags it needs; compiling needs a C++ compiler (here, at export
    time only). Returns the file's name and the kept package's times (ms)."""
    from torch._inductor import aoti_compile_and_package
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    vec_isa = pick_vec_isa()
    isa = str(vec_isa)
    flags = isa_cpu_flags(vec_isa.build_arch_flags())
    name = f"{stem}.pt2" if precision == "fp32" else f"{stem}_{precision}.pt2"
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    module = network if dtype == torch.float32 else copy.deepcopy(network).to(dtype)
    bound = 1e-5 if dtype == torch.float32 else BF16_PACKAGE_BOUND

    def cast(inputs: tuple) -> tuple:
        return tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs)

    started = time.time()
    with torch.no_grad():
        program = torch.export.export(module, cast(example), dynamic_shapes=dynamic_shapes)
    times = {}
    for label, settings in PACKAGE_SETTINGS.items():
        candidate = out / f".{label.replace(' ', '_')}-{name}"
        with torch.no_grad():
            # No -march=native: the package runs on every CPU with the ISA it records.
            path = aoti_compile_and_package(program, package_path=str(candidate), inductor_configs={
                **settings,
                "cpp.march": "",
                # Kernels that find libtorch_cpu's symbols in the process (Narsil
                # links it) instead of linking libtorch.so, whose loading would
                # bring libtorch_cuda and its CUDA libraries (~280 MiB resident).
                "aot_inductor.link_libtorch": False,
                "aot_inductor.metadata": {"narsil_cpu_flags": " ".join(flags), "narsil_vec_isa": isa,
                                          "narsil_settings": label, "narsil_links_libtorch": "false"},
            })
        package = load_unlinked_package(path)
        with torch.inference_mode():
            for inputs in checked:
                diff = (package(*cast(inputs)).float() - network(*inputs)).abs().max().item()
                if diff > bound:
                    raise SystemExit(f"{name} ({label}) check failed: {diff} from the network at "
                                     f"{inputs[1].shape[0]} rows")
        times[label] = (candidate, [forward_ms(package, cast(inputs)) for inputs in timed])
        del package
    best = min(times, key=lambda label: sum(ms / rows for ms, rows in zip(times[label][1], TIMED_ROWS)))
    for label, (candidate, _) in times.items():
        if label == best:
            candidate.replace(out / name)
        else:
            candidate.unlink()
    measured = "; ".join(f"{label} {ms[0]:.2f} / {ms[1]:.1f} ms" for label, (_, ms) in times.items())
    log(f"compiled {name} with AOTInductor for {isa} in {time.time() - started:.0f} s, kept {best} "
        f"(one thread, {' / '.join(f'{rows:,}' for rows in TIMED_ROWS)} rows: {measured}; "
        f"scores within {bound:g} of the FP32 network)")
    return name, times[best][1]


def write_dense_packages(out: Path, dense_network: nn.Module, num_dense: int, pooled_width: int, log) -> dict:
    """`dense_network`'s AOTInductor packages (write_dense_package): FP32,
    and bf16 where this CPU has bf16 instructions; the schema's fields
    naming them, and `dense_form_timings`: each precision's package and
    TorchScript network (`out/dense.pt`, written before) timed on this CPU
    (form_timings)."""
    timings = {"cpu": cpu_identity(), "rows": list(TIMED_ROWS)}
    packages = {}
    for precision in package_precisions():
        name, pt2_ms = write_dense_package(out, dense_network, num_dense, pooled_width, log, precision=precision)
        packages["dense_package" if precision == "fp32" else f"dense_package_{precision}"] = name
        timings[precision] = form_timings(out, num_dense, pooled_width, precision, pt2_ms, log)
    if not cpu_has_bf16():
        log("dense_bf16.pt2 not compiled: this CPU has no bf16 instructions (AVX512-BF16 or AMX-BF16)")
    packages["dense_form_timings"] = {key: value for key, value in timings.items() if value != {}}
    return packages

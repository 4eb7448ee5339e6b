"""INT8 dense packages: a split model's pooled dense network statically
quantized (PT2E with torchao's X86InductorQuantizer, default config:
per-channel symmetric INT8 weights, per-tensor asymmetric uint8
activations), calibrated on sampled traffic pooled from the model's own
tables, compiled by AOTInductor with freezing (which turns the
quantize/dequantize pattern into oneDNN INT8 linear layers on prepacked
weights) into `dense_int8.pt2`, with its quality contract measured by the
package itself against the FP32 network in `int8_quality.json`.

Used by `export_dlrm.py --int8` (the DLRM) and `export_torchrec.py --int8`
(DLRM_DCN, MLPerf's DLRM-v2 shape)."""

import json
import os
import time
import zipfile
from pathlib import Path
from typing import Callable, List, Optional

import torch
from torch import nn

from dense_packages import cpu_flags, cpu_identity, forward_ms, isa_cpu_flags, load_unlinked_package

# /proc/cpuinfo flags of the INT8 dot-product instructions oneDNN's INT8 GEMMs
# use where the CPU has them. Without them (AVX2) oneDNN multiplies with
# vpmaddubsw, which adds each pair of uint8 x int8 products in a saturating
# 16-bit lane: activations are then quantized to 7 bits (torchao's
# reduce_range, its advice for CPUs without VNNI), so no pair can saturate.
INT8_CPU_FLAGS = ("amx_int8", "avx512_vnni", "avx_vnni")
INT8_FALLBACK_FLAG = "avx2"
# The quality goal: the AUC of INT8 scores on labels drawn from the FP32
# model's own probabilities within this of the FP32 scores' AUC.
INT8_AUC_GOAL = 1e-3
# A package further than this from FP32 on the golden requests is a broken
# quantization, not a quality trade: the export fails.
INT8_GOLDEN_BOUND = 5e-2
INT8_CALIBRATION_SAMPLES = 4_000
INT8_SAMPLED = 10_000


def int8_cpu_flags() -> List[str]:
    """The flags of this CPU's instructions an INT8 package is compiled
    for: its INT8 dot-product instructions, else `avx2` (activations in 7
    bits, `activation_bits`); none where it has neither (no INT8 package)."""
    flags = cpu_flags()
    dot = [f for f in INT8_CPU_FLAGS if f in flags]
    return dot or [f for f in (INT8_FALLBACK_FLAG,) if f in flags]


def activation_bits(int8_flags: List[str]) -> int:
    """8 where the package's INT8 instructions are dot products (VNNI, AMX),
    7 on AVX2 (INT8_CPU_FLAGS' comment)."""
    return 8 if any(f in INT8_CPU_FLAGS for f in int8_flags) else 7


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney, tied scores share their
    average rank)."""
    scores, labels = scores.double(), labels.double()
    values, inverse, counts = torch.unique(scores, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    average_rank = ends - (counts.double() - 1) / 2  # 1-based
    ranks = average_rank[inverse]
    positives = labels.sum().item()
    negatives = len(labels) - positives
    if positives == 0 or negatives == 0:
        return float("nan")
    return ((ranks * labels).sum().item() - positives * (positives + 1) / 2) / (positives * negatives)


def log_loss(probabilities: torch.Tensor, labels: torch.Tensor) -> float:
    p = probabilities.double().clamp(1e-7, 1 - 1e-7)
    y = labels.double()
    return -(y * p.log() + (1 - y) * (1 - p).log()).mean().item()


def wrapper_sources(f) -> bytes:
    """The generated C++ wrapper sources of an AOTInductor package."""
    with zipfile.ZipFile(f) as z:
        return b"".join(z.read(n) for n in z.namelist() if n.endswith("wrapper.cpp"))


def write_int8_package(split_dir: Path, fp32_network: nn.Module, network: nn.Module, example: tuple,
                       calibration: List[tuple], golden: List[tuple], sampled: List[tuple], seed: int,
                       described: dict, log: Callable[[str], None], extra_cpu_flags: List[str] = (),
                       metadata: Optional[dict] = None) -> dict:
    """Quantizes `network` (the FP32 network's layers in the form to
    quantize: every GEMM an `nn.Linear`, which is what the quantizer
    annotates) calibrated on `calibration`, compiles `split_dir/dense_int8.pt2`
    and writes `split_dir/int8_quality.json`: the package's scores against
    `fp32_network`'s on `golden` and `sampled` (lists of input tuples) and
    on labels drawn from the FP32 probabilities (seed `seed`).
    `described`: the quality file's `distribution` of the sampled inputs,
    `calibration` source and `quantization` text, and any other fields to
    record. Fails when the package holds no INT8 linear layers or is
    further than INT8_GOLDEN_BOUND from FP32 on `golden`. Returns the
    schema fields to add: the package, and where FP32's forms were timed on
    this CPU, its own times beside them (`dense_form_timings.int8`)."""
    from torch._inductor import aoti_compile_and_package
    import torch._inductor.config
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    # Importing the quantizer registers its Inductor passes (INT8 weight prepacking, post-op fusion).
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
        X86InductorQuantizer, get_default_x86_inductor_quantization_config)

    started = time.time()
    described = dict(described)
    int8_flags = int8_cpu_flags()
    bits = activation_bits(int8_flags)
    rows = torch.export.Dim("rows", min=1, max=1 << 20)
    dynamic = tuple({0: rows} for _ in example)
    quantizer = X86InductorQuantizer()
    quantizer.set_global(get_default_x86_inductor_quantization_config(reduce_range=bits < 8))
    with torch.no_grad():
        graph = torch.export.export(network, example, dynamic_shapes=dynamic).module()
        prepared = prepare_pt2e(graph, quantizer)
        for inputs in calibration:
            prepared(*inputs)
        converted = convert_pt2e(prepared)
        program = torch.export.export(converted, example, dynamic_shapes=dynamic)
    vec_isa = pick_vec_isa()
    needs = isa_cpu_flags(vec_isa.build_arch_flags())
    for flag in int8_flags[:1] + list(extra_cpu_flags):
        if flag not in needs:
            needs.append(flag)
    path = split_dir / "dense_int8.pt2"
    # Freezing must be on in Inductor's global config when AOTInductor lowers
    # the graph: passed in inductor_configs, the INT8 patterns were not
    # matched (the package ran FP32 addmm on dequantized weights).
    with torch.no_grad(), torch._inductor.config.patch(freezing=True):
        aoti_compile_and_package(program, package_path=str(path), inductor_configs={
            "cpp.march": "",
            "aot_inductor.link_libtorch": False,
            "aot_inductor.metadata": {"narsil_cpu_flags": " ".join(needs), "narsil_vec_isa": str(vec_isa),
                                      "narsil_settings": "int8 pt2e x86 inductor, freezing",
                                      "narsil_links_libtorch": "false", **(metadata or {})},
        })
    compiled_s = time.time() - started
    package = load_unlinked_package(str(path))
    with open(path, "rb") as f:
        sources = wrapper_sources(f)
    int8_linears = sources.count(b"aoti_torch_cpu__qlinear_pointwise")
    fp32_linears = sources.count(b"aoti_torch_cpu__linear_pointwise")
    if int8_linears == 0:
        raise SystemExit(f"{path}: no INT8 linear layers in the compiled package (Inductor did not lower "
                         "the quantized pattern); not writing an INT8 package that computes in FP32")

    def scores(inputs: List[tuple]) -> tuple:
        with torch.inference_mode():
            fp32 = torch.cat([fp32_network(*i) for i in inputs])
            int8 = torch.cat([package(*i) for i in inputs])
        return fp32, int8

    def diff(a: torch.Tensor, b: torch.Tensor) -> dict:
        return {"max_abs_diff": (a - b).abs().max().item(), "mean_abs_diff": (a - b).abs().mean().item(),
                "samples": len(a)}

    timed = int8_timings(split_dir, package, example)
    golden_fp32, golden_int8 = scores(golden)
    sampled_fp32, sampled_int8 = scores(sampled)
    labels = torch.bernoulli(sampled_fp32.double(), generator=torch.Generator().manual_seed(seed))
    auc_fp32, auc_int8 = auc(sampled_fp32, labels), auc(sampled_int8, labels)
    loss_fp32, loss_int8 = log_loss(sampled_fp32, labels), log_loss(sampled_int8, labels)
    quality = {
        "package": path.name,
        "reference": "the FP32 dense network on the same pooled embeddings (dense.pt's arithmetic)",
        "golden": {**diff(golden_int8, golden_fp32), "requests": len(golden)},
        "sampled": {**diff(sampled_int8, sampled_fp32), "requests": len(sampled),
                    "distribution": described.pop("distribution")},
        "labelled": {
            "samples": len(labels), "positives": int(labels.sum().item()),
            # Where the FP32 probabilities barely spread (random weights: all near 0.5), labels drawn
            # from them are nearly coin flips and both AUCs are near 0.5: judge the AUC change with this.
            "fp32_probability_mean": sampled_fp32.mean().item(), "fp32_probability_std": sampled_fp32.std().item(),
            "labels": f"Bernoulli(FP32 probability) on the sampled requests, seed {seed}",
            "fp32": {"log_loss": loss_fp32, "auc": auc_fp32},
            "int8": {"log_loss": loss_int8, "auc": auc_int8},
            "log_loss_change": loss_int8 - loss_fp32, "auc_change": auc_int8 - auc_fp32,
            "auc_change_goal": INT8_AUC_GOAL, "auc_goal_met": abs(auc_int8 - auc_fp32) <= INT8_AUC_GOAL,
        },
        "calibration": {"samples": sum(len(i[0]) for i in calibration), "source": described.pop("calibration")},
        "linear_layers": {"int8": int8_linears, "fp32": fp32_linears},
        **described,
        "int8_instructions": int8_flags,
        "activation_bits": bits,
        "timed": timed,
        "torchao": __import__("torchao").__version__, "torch": torch.__version__,
    }
    (split_dir / "int8_quality.json").write_text(json.dumps(quality, indent=2) + "\n")
    g, s, lab = quality["golden"], quality["sampled"], quality["labelled"]
    log(f"compiled dense_int8.pt2 ({', '.join(int8_flags)}, activations in {bits} bits; {int8_linears} INT8 and "
        f"{fp32_linears} FP32 linear "
        f"layers) in {compiled_s:.0f} s; quality against FP32 (int8_quality.json): golden max "
        f"{g['max_abs_diff']:.2e} mean {g['mean_abs_diff']:.2e}; {s['samples']:,} sampled max "
        f"{s['max_abs_diff']:.2e} mean {s['mean_abs_diff']:.2e}; labelled: log-loss change "
        f"{lab['log_loss_change']:+.2e}, AUC change {lab['auc_change']:+.2e} (goal |change| <= {INT8_AUC_GOAL:g}: "
        f"{'met' if lab['auc_goal_met'] else 'MISSED'})")
    if timed:
        log(f"INT8 against FP32 on this CPU ({timed['cpu']}), one thread, "
            f"{' / '.join(f'{r:,}' for r in timed['rows'])} rows: INT8 "
            f"{' / '.join(f'{us / 1e3:.2f}' for us in timed['int8_us'])} ms, FP32's faster form "
            f"{' / '.join(f'{us / 1e3:.2f}' for us in timed['fp32_us'])} ms: INT8 serves "
            f"{timed['int8_vs_fp32']:.2f}x FP32's samples/s here")
    print(json.dumps(quality, indent=2))
    if g["max_abs_diff"] > INT8_GOLDEN_BOUND:
        raise SystemExit(f"{path}: INT8 scores differ from FP32 by {g['max_abs_diff']} on the golden requests "
                         f"(bound {INT8_GOLDEN_BOUND}): the quantization is broken")
    fields = {"dense_package_int8": path.name}
    if timed:
        # Beside FP32's forms in the schema, where the server reads it: it says at load how INT8 compared
        # on this kind of CPU, and warns where INT8 was the slower.
        timings = json.loads((split_dir / "schema.json").read_text())["dense_form_timings"]
        fields["dense_form_timings"] = {**timings, "int8": {"pt2_us": timed["int8_us"]}}
    return fields


def int8_timings(split_dir: Path, package, example: tuple) -> dict:
    """The package timed on one thread at the rows the export timed FP32's
    forms at (the schema's dense_form_timings, this CPU's), against FP32's
    faster form: whether INT8 pays on this CPU (a small network on AVX2 may
    gain little). Empty where FP32 was not timed here."""
    timings = json.loads((split_dir / "schema.json").read_text()).get("dense_form_timings") or {}
    fp32 = timings.get("fp32")
    if not fp32 or timings.get("cpu") != cpu_identity():
        return {}
    rows = timings["rows"]
    widths = [x.shape[1:] for x in example]
    int8_us = [round(forward_ms(package, tuple(torch.randn(r, *w) for w in widths)) * 1e3) for r in rows]
    fp32_us = [min(t, p) for t, p in zip(fp32["torchscript_us"], fp32["pt2_us"])]
    ratio = sum(f / r for f, r in zip(fp32_us, rows)) / sum(i / r for i, r in zip(int8_us, rows))
    return {"cpu": timings["cpu"], "rows": rows, "int8_us": int8_us, "fp32_us": fp32_us,
            "int8_vs_fp32": round(ratio, 3)}


def add_to_schema(split_dir: Path, fields: dict) -> None:
    """Adds `fields` to `split_dir/schema.json` (written new and renamed into
    place: a published version may hard-link the old one)."""
    schema_path = split_dir / "schema.json"
    schema = json.loads(schema_path.read_text())
    schema.update(fields)
    staging = split_dir / ".schema.json.new"
    staging.write_text(json.dumps(schema, indent=2) + "\n")
    os.replace(staging, schema_path)

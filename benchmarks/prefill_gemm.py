"""The int8-activation matmuls at a prefill's row counts: the decode-shaped loops (native/lowbit_dot.h, one weight
row at a time against up to four activation rows) against the blocked loops (native/lowbit_gemm.h, register tiles
of 4 weight rows x 4 activation rows), side by side on the machine at hand; both take the activations in
L2-sized blocks of rows.

    python benchmarks/prefill_gemm.py [--threads 1] [--rows 64 256 1024] [--json OUT] [--record]

Per shape (Qwen3-30B-A3B's expert gate+up [1536, 2048] and down [2048, 768], attention q [4096, 2048]) and
format, one matmul at each row count (a 4,096-token piece routes about 256 tokens to each of its 128 experts
at top-8, and "auto" times 32 rows besides one): the fastest of several runs of each loop, the two alternating,
in each SIMD variant this CPU has (and, beside the best variant, float activations through torch's kernel),
with the int8 ops per second and their share of the CPU's int8 peak (core/kernel_timing.py, measured beside
it on as many threads). Both loops compute the same bits; each result is checked equal here too.

--record writes the table as this machine's record of prefill-gemm (benchmarks/machine.py).
"""

from __future__ import annotations

import argparse
import functools

import machine
import torch

from moestream.conversion.quant import QuantFormat, pack, quantize
from moestream.core import kernel_timing
from moestream.core.compute import kernels

SHAPES = {"expert gate+up": (1536, 2048), "expert down": (2048, 768), "attention q": (4096, 2048)}
FORMATS = [("int4", 64), ("int4", 128), ("int6", 64), ("int8", None), ("int4", 32)]
ISAS = ["portable", "avx2", "avx512-vnni"]
NEVER = 1 << 40  # a row count no matmul reaches: the decode-shaped loops throughout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--json", help="write the results here too")
    machine.add_record_argument(parser, "prefill-gemm")
    args = parser.parse_args()
    ext = machine.compiled_kernels()
    torch.set_num_threads(args.threads)
    previous_isa, default_rows = ext.lowbit_isa(""), ext.lowbit_gemm_rows(0)
    best_isa = ext.lowbit_isa(ISAS[-1])
    ext.lowbit_isa(previous_isa)
    names = ISAS[1 : ISAS.index(best_isa) + 1] or ["portable"]
    peak = kernel_timing.int8_peak_ops_per_second()
    print(f"machine: {machine.line()}; {args.threads} threads; variants: {', '.join(names)}")
    print(
        f"int8 peak (torch's int8 GEMM, {args.threads} threads): {peak / 1e9:.0f} GOPS\n" if peak else "int8 peak: not measured\n"
    )
    results: dict = {"threads": args.threads, "peak_ops": peak, "variants": names, "matmuls": []}
    print(
        f"{'variant':<12} {'shape':<16} {'format':<9} {'rows':>5} {'loops ms':>9} {'blocked ms':>10}  ratio  GOPS (share of peak)"
    )
    try:
        for variant in names:
            ext.lowbit_isa(variant)
            for shape, (n, k) in SHAPES.items():
                for name, group in FORMATS:
                    fmt = QuantFormat.make(name, group or 32)
                    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k))
                    record = pack(quantize(w, fmt), fmt, "w")
                    qweight, params = record["w.qweight"], record[f"w.{fmt.params}"]
                    fast = kernels.cpu_record(record, fmt)["w.qweight"] if fmt.torch_kernel else None
                    for m in args.rows:
                        x = torch.randn(m, k, dtype=torch.bfloat16)
                        run = functools.partial(kernels.quantized_matmul, x, qweight, params, fmt, True)
                        # float activations: torch's kernel on its own layout (what "auto" weighs them against)
                        floating = (
                            functools.partial(kernels.quantized_matmul, x, fast, params, fmt, False) if fast is not None else None
                        )
                        best = {"loops": float("inf"), "blocked": float("inf"), "float": float("inf")}
                        out = {}
                        for _ in range(3):  # alternating, so that a busy moment slows each
                            for loop, rows in (("loops", NEVER), ("blocked", default_rows)):
                                ext.lowbit_gemm_rows(rows)
                                out[loop] = run()
                                best[loop] = min(best[loop], kernels.fastest_ms(run, 2))
                            if floating is not None and variant == names[-1]:
                                best["float"] = min(best["float"], kernels.fastest_ms(floating, 2))
                        if not torch.equal(out["loops"], out["blocked"]):
                            raise SystemExit(f"the two loops disagree: {variant} {shape} {name} {m} rows")
                        ops = 2 * m * n * k / (best["blocked"] / 1e3)
                        share = f" ({ops / peak:.0%})" if peak else ""
                        ratio = best["loops"] / best["blocked"]
                        versus = (
                            f"  float {best['float']:.3f} ms ({best['float'] / best['blocked']:.2f}x)"
                            if best["float"] < float("inf")
                            else ""
                        )
                        print(
                            f"{variant:<12} {shape:<16} {label(name, group):<9} {m:>5} {best['loops']:>9.3f} {best['blocked']:>10.3f}  "
                            f"{ratio:.2f}x  {ops / 1e9:.0f}{share}{versus}",
                            flush=True,
                        )
                        results["matmuls"].append(
                            dict(
                                variant=variant,
                                shape=shape,
                                n=n,
                                k=k,
                                format=label(name, group),
                                rows=m,
                                ms={key: v if v < float("inf") else None for key, v in best.items()},
                                ops=ops,
                            )
                        )
    finally:
        ext.lowbit_isa(previous_isa)
        ext.lowbit_gemm_rows(default_rows)
    if args.json:
        machine.write_json(args.json, results)
    if args.record:
        record_result(args, results)


def label(name: str, group: int | None) -> str:
    return f"{name}-g{group}" if group else name


def record_result(args, results: dict) -> None:
    peak = results["peak_ops"]
    caption = (
        f"One matmul at a prefill's row counts, {args.threads} threads, weights in cache: the fastest of several runs of each "
        "loop, the two alternating (ms); GOPS of the blocked loops and their share of the int8 peak"
        + (f" ({peak / 1e9:.0f} GOPS, torch's int8 GEMM on as many threads):" if peak else ":")
    )
    columns = [
        "variant",
        "shape",
        "format",
        "rows",
        "decode loops ms",
        "blocked ms",
        "ratio",
        "GOPS (share of peak)",
        "float activations ms (ratio)",
    ]
    rows = [
        [
            r["variant"],
            f"{r['shape']} [{r['n']}, {r['k']}]",
            r["format"],
            r["rows"],
            f"{r['ms']['loops']:.3f}",
            f"{r['ms']['blocked']:.3f}",
            f"**{r['ms']['loops'] / r['ms']['blocked']:.2f}x**",
            f"{r['ops'] / 1e9:.0f}" + (f" ({r['ops'] / peak:.0%})" if peak else ""),
            f"{r['ms']['float']:.3f} ({r['ms']['float'] / r['ms']['blocked']:.2f}x)" if r["ms"]["float"] is not None else "",
        ]
        for r in results["matmuls"]
    ]
    notes = (
        "Both loops give the same bits (checked in the run), and both take the activation rows in blocks of 128. The "
        "register tiles are AVX-512 VNNI only: on the AVX2 variant, and for int4 g32 (which runs the AVX2 loops under "
        "either variant, lowbit_dot.h's int4_variant), both columns run the same loops, and their ratio shows the noise. "
        "Float activations: torch's kernel on its own layout (int4 and int8; none for int6), timed beside the best variant "
        "only; its ratio is its time over the blocked loops'."
    )
    path = machine.write_result(
        args.record,
        "The int8-activation matmuls at prefill row counts",
        machine.invocation(),
        [machine.table(caption, columns, rows)],
        notes,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

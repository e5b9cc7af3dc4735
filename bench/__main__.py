"""``python -m bench SUITE [args]``: one benchmark CLI.

Suites: logits, linear, sync, host, e2e, checkpoint, tune (each prints a table and writes JSON + PNG into ``--out``,
default ``bench/out/``; ``--quick`` is a CPU smoke run) and gpu (every check and benchmark on a GPU machine, see
docs/kernels.md); report prints the benchmark tables for committed runs (``--readme`` rewrites the generated blocks
of README.md and docs/benchmarks.md). ``python -m bench SUITE --help`` for a suite's flags.
"""
import importlib
import sys

SUITES = {"logits": ("bench.bench_logits", "logits path: token log-probs and fused losses, fwd+bwd, vs peers"),
          "linear": ("bench.bench_linear", "fused linear path (hidden + lm_head weight), vs the GEMM floor and peers"),
          "sync": ("bench.bench_sync", "reference sync: copy bandwidth, overlap with compute, FSDP2 step"),
          "host": ("bench.bench_host", "kernel launches and CPU enqueue vs GPU time of one loss call"),
          "e2e": ("bench.bench_e2e",
                  "one DPO step of a 1.5 B Llama: offline (with a reference forward) vs humanline, plain and in TRL"),
          "checkpoint": ("bench.bench_checkpoint",
                         "checkpoint size and time with the humanline reference, schedule only, and stock"),
          "tune": ("bench.bench_tune", "launch configurations timed on this GPU: the table the launchers read"),
          "gpu": ("bench.bench_gpu", "GPU machine: GPU tests, parity at N=8192 V=128256, demo, all benchmarks"),
          "report": ("bench.report", "the generated pages' numbers from committed runs (print, --readme, --check)")}


def _usage() -> str:
    lines = ["usage: python -m bench SUITE [--help] [args]", "", "suites:"]
    lines += [f"  {name:10s} {text}" for name, (_, text) in SUITES.items()]
    return "\n".join(lines)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if not argv or argv[0] not in SUITES:
        got = f"unknown suite {argv[0]!r}" if argv else "no suite given"
        print(f"python -m bench: {got}; choose one of {', '.join(SUITES)} (python -m bench --help)", file=sys.stderr)
        return 2
    return importlib.import_module(SUITES[argv[0]][0]).main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())

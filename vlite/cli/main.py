"""The ``vlite`` command: one Typer app, one module per subcommand."""

from __future__ import annotations

from vlite.engine import apply_openmp_defaults

# before anything imports torch: OpenMP reads its wait policy once, when it loads (cpu_threads.py)
apply_openmp_defaults()

import typer  # noqa: E402

from vlite import __version__  # noqa: E402
from vlite.cli import generate  # noqa: E402

app = typer.Typer(
    name="vlite",
    help="A readable paged-KV-cache LLM server that diagnoses KV-cache and memory leaks.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Plain help: Rich's panels cut long option names (--max-num-batched-tokens) at 80 columns.
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"vlite {__version__}")
        raise typer.Exit()


@app.callback()
def main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                      help="Print the version and exit.")) -> None:
    """vlite: vLLM's design in a few thousand readable lines."""


app.command("generate")(generate.generate)


def _register_optional() -> None:
    import importlib

    try:
        serve = importlib.import_module("vlite.cli.serve")
    except ModuleNotFoundError as exc:
        if exc.name != "vlite.cli.serve":
            raise
    else:
        app.command("serve")(serve.serve)
    for module, name in (("vlite.cli.leak_check", "leak-check"), ("vlite.cli.bench", "bench")):
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            continue
        app.add_typer(mod.app, name=name)


_register_optional()

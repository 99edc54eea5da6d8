"""The typer application every command module registers itself on."""

from __future__ import annotations

import typer

from .help_layout import install

install()  # --help keeps option names whole at 80 columns

app = typer.Typer(
    name="reproduce",
    help=(
        "Reproduce a paper's large-batch training recipe on the hardware you have: plan the micro-batch and "
        "accumulation steps that keep the paper's effective batch exact, run it, and check it in CI."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _show_version(value: bool) -> None:
    if value:
        from .. import __version__

        print(f"reproduce {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: bool = typer.Option(False, "--version", callback=_show_version, is_eager=True, help="Print the version."),
) -> None:
    """Reproduce a paper's large-batch recipe: `plan`, `run`, and check it in CI."""

"""``apiary deploy``: Kubernetes manifests of the platform.

* ``apiary deploy render --values FILE --out DIR``: render the manifests the values give (defaults
  and every key: ``deploy/kubernetes/values.yaml``) into DIR, one file per manifest, and print
  their paths; ``kubectl apply -f DIR`` then applies them in order (see deploy/kubernetes/README.md).
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from apiary.errors import ApiaryError

deploy_app = typer.Typer(no_args_is_help=True, help="Deploy the platform to Kubernetes (manifests).")
err = Console(stderr=True)


@deploy_app.command("render")
def render_command(
    values: Path = typer.Option(..., "--values", exists=True, dir_okay=False, help="Values YAML."),
    out: Path = typer.Option(..., "--out", file_okay=False, help="Directory for the manifests (created)."),
) -> None:
    """Render the Kubernetes manifests into DIR, one file per manifest; prints their paths."""
    from apiary.deploy import render

    try:
        paths = render(values, out)
    except ApiaryError as e:
        err.print(f"error: {e.message}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    for path in paths:
        print(path)

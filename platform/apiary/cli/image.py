"""``apiary image``: the local base image, the examples' and Apiary's own images, the registry.

The registry is the one ``apiary up --runtime docker`` started (its URL is in
``APIARY_HOME/run/urls.json``) unless ``--registry host:port`` names another.
"""

from __future__ import annotations

import json
import subprocess

import typer
from rich.console import Console
from rich.table import Table

from apiary.errors import ApiaryError, ValidationError

image_app = typer.Typer(no_args_is_help=True, help="Build, push and list the Docker runtime's images.")
console = Console()
err = Console(stderr=True)


def _fail(e: ApiaryError) -> None:
    err.print(f"[red]error[/red] ({e.status_code}): {e.message}", highlight=False, soft_wrap=True)
    raise typer.Exit(1)


def _registry(registry: str | None) -> str:
    """``host:port`` of ``--registry``, else of the running platform's registry."""
    if registry:
        return registry.removeprefix("http://")
    from apiary.settings import Settings

    urls = Settings().home_dir / "run" / "urls.json"
    try:
        found = json.loads(urls.read_text()).get("registry")
    except (OSError, ValueError):
        found = None
    if not found:
        raise ValidationError("registry", "no platform registry found: run `apiary up --runtime docker` "
                                          "or pass --registry host:port")
    return str(found).removeprefix("http://")


def git_commit() -> str:
    """The short commit of the working tree (the tag of Apiary's own images), ``dev`` outside git."""
    from apiary.images.build import REPO

    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "dev"
    except (OSError, subprocess.TimeoutExpired):
        return "dev"


@image_app.command("build-base")
def build_base(
    tag: str = typer.Option("apiary/base:bookworm", help="Name of the imported image."),
    mirror: str | None = typer.Option(None, help="Debian mirror URL (debootstrap's default otherwise)."),
) -> None:
    """Build the minimal Debian base (debootstrap minbase + python3, then docker import; ~60 s, root)."""
    from apiary.images.build import build_base as build
    from apiary.images.daemons import docker_client

    try:
        image_id = build(docker_client(), tag=tag, mirror=mirror)
    except ApiaryError as e:
        _fail(e)
    console.print(f"{tag} {image_id[:19]}")


@image_app.command("build")
def build(
    names: list[str] = typer.Argument(None, help="Example images to build (default: all of them)."),
    platform: bool = typer.Option(False, "--platform", help="Build Apiary's own images instead (deploy/docker/)."),
    registry: str | None = typer.Option(None, help="Registry host:port (default: the platform's)."),
    tag: str | None = typer.Option(None, help="Tag (default: latest for examples, the git commit for --platform)."),
) -> None:
    """Build images from their Dockerfiles and push them to the registry."""
    from apiary.images import build as images
    from apiary.images.daemons import docker_client

    try:
        client, address = docker_client(), _registry(registry)
        if platform:
            built = images.build_platform(client, address, tag or git_commit())
        else:
            names = names or sorted(images.EXAMPLES)
            built = [images.build_example(client, n, address, tag or "latest") for n in names]
    except ApiaryError as e:
        _fail(e)
    for name in built:
        console.print(f"pushed {name}")


@image_app.command("list")
def list_(registry: str | None = typer.Option(None, help="Registry host:port (default: the platform's).")) -> None:
    """The registry's repositories and tags."""
    from apiary.images.daemons import list_images

    try:
        found = list_images(f"http://{_registry(registry)}")
    except ApiaryError as e:
        _fail(e)
    table = Table("REPOSITORY", "TAGS")
    for repo, tags in sorted(found.items()):
        table.add_row(repo, ", ".join(tags))
    console.print(table)

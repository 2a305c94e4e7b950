"""``apiary image``: the image catalogue (through the REST API), user builds, and the admin's local
builds of the base image, the examples' and Apiary's own images.

* ``apiary image list [--framework F] [--cuda C] [--mine] [-q TEXT]``: ``GET /api/v2/images``, the
  shared images and the caller's own.
* ``apiary image build --from-dir DIR --name NAME [--tag T] [--shared]``: the directory is sent as a
  tar archive to ``POST /api/v2/images/builds``; the platform builds and pushes it.
* ``apiary image build [NAMES] [--platform]`` and ``build-base``: built here with the local dockerd
  (root), pushed to the registry ``apiary up --runtime docker`` started (its URL is in
  ``APIARY_HOME/run/urls.json``) unless ``--registry host:port`` names another.
"""

from __future__ import annotations

import json
import subprocess
import tarfile
import tempfile
from pathlib import Path

import typer
from rich.console import Console

from apiary.cli.common import api_client, fail
from apiary.cli.tables import print_rows
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
    from_dir: Path | None = typer.Option(
        None, "--from-dir", help="Upload this directory (a Dockerfile at its top, FROM apiary/base:bookworm or a "
                                 "shared image) and have the platform build it as users/<you>/<name>."),
    name: str | None = typer.Option(None, "--name", help="The image's name (with --from-dir)."),
    shared: bool = typer.Option(False, "--shared", help="With --from-dir: publish as apiary/<name> (admins)."),
    description: str | None = typer.Option(None, help="With --from-dir: the image's description label."),
) -> None:
    """Build images: a directory through the platform (--from-dir), or, as the platform's admin on
    its machine, the examples' or Apiary's own images from their Dockerfiles, pushed to the registry."""
    if from_dir is not None:
        _build_remote(from_dir, name, tag or "latest", shared, description)
        return
    if name is not None or shared or description is not None:
        _fail(ValidationError("from-dir", "--name, --shared and --description go with --from-dir"))
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


def pack(directory: Path, dest: Path) -> None:
    """Write ``directory``'s contents as the tar ``dest`` (names relative to it; symbolic links kept
    as links, so a link out of the directory is refused by the platform rather than followed here).
    Raises :class:`ValidationError` (field ``from-dir``) when it is no directory or has no Dockerfile."""
    if not directory.is_dir():
        raise ValidationError("from-dir", f"{directory} is no directory")
    if not (directory / "Dockerfile").is_file():
        raise ValidationError("from-dir", f"{directory} has no Dockerfile at its top")
    with tarfile.open(dest, "w") as tar:
        for child in sorted(directory.iterdir()):
            tar.add(child, arcname=child.name)


def _build_remote(directory: Path, name: str | None, tag: str, shared: bool, description: str | None) -> None:
    if not name:
        fail(ValidationError("name", "--from-dir needs --name"))
    with tempfile.TemporaryDirectory(prefix="apiary-image-") as tmp:
        archive = Path(tmp) / "context.tar"
        try:
            pack(directory.expanduser(), archive)
            image = api_client().build_image(archive, name, tag=tag, shared=shared, description=description)
        except ApiaryError as e:
            fail(e)
    console.print(f"pushed {image['reference']} {image['digest']}", highlight=False)


def human_size(n: int) -> str:
    """``123 B``, ``4.5 KiB``, ``67.8 MiB``, ``1.2 GiB``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"  # pragma: no cover - the loop returns


def short_digest(digest: str) -> str:
    """``sha256:`` + the first 12 hex digits (Docker's short id)."""
    algo, _, hexpart = digest.partition(":")
    return f"{algo}:{hexpart[:12]}" if hexpart else digest[:19]


@image_app.command("list")
def list_(
    framework: str | None = typer.Option(None, "--framework", help="Only images of this framework (e.g. numpy)."),
    cuda: str | None = typer.Option(None, "--cuda", help="Only images of this CUDA version ('none': CPU only)."),
    mine: bool = typer.Option(False, "--mine", help="Only your own images (users/<you>/...)."),
    q: str | None = typer.Option(None, "-q", "--query", help="Words in the name or description."),
    as_json: bool = typer.Option(False, "--json", help="The API's JSON instead of a table."),
) -> None:
    """The image catalogue: the shared images (apiary/...) and your own (users/<you>/...)."""
    try:
        found = api_client().images(framework=framework, cuda=cuda, q=q, mine=mine)
    except ApiaryError as e:
        fail(e)
    if as_json:
        console.print_json(json.dumps(found))
        return
    rows = [[i["repository"], i["tag"], i.get("framework") or "-", i.get("cuda") or "-", human_size(i["sizeBytes"]),
             short_digest(i["digest"]), i.get("authors") or "-"] for i in found]
    print_rows(console, ["IMAGE", "TAG", "FRAMEWORK", "CUDA", "SIZE", "DIGEST", "BUILT BY"], rows,
               sentence="DESCRIPTION", sentences=[i.get("description") or "" for i in found])

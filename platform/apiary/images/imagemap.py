"""The image map: public image names (what OpenPAI job files say) -> names in Apiary's registry.

No image can be pulled from outside on Apiary's build machines, so Lab 6's files, which name
``openpai/pai.example.pytorch``, run unmodified only if that name resolves to an image built here.
The map is a YAML mapping, ``image-map.yaml`` in this package (the defaults, documented there) or
a file given to ``apiary agent --image-map`` / written by ``apiary up --runtime docker`` into
``APIARY_HOME/image-map.yaml``. ``{registry}`` in a value is the platform registry's
``host:port``. Keys without a tag match every tag of the name, keys ending in ``/`` every name
under them (see :func:`apiary.runtime.docker.resolve_image`).

With a registry, the image catalogue's names resolve too (:data:`CATALOGUE`, unless the file maps
them otherwise): ``apiary/<name>:<tag>`` and ``users/<user>/<name>:<tag>`` to the registry, and
``apiary/base`` (the local base image, never pushed) to itself.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from apiary.errors import ValidationError
from apiary.spec import safeyaml

#: The catalogue's namespaces, added to every map loaded with a registry (``{registry}``
#: substituted) unless the map has the key. ``apiary/base`` stays the local image.
CATALOGUE = {"apiary/base": "apiary/base", "apiary/": "{registry}/apiary/", "users/": "{registry}/users/"}


def default_text() -> str:
    """The shipped defaults (``apiary/images/image-map.yaml``), ``{registry}`` unsubstituted."""
    return resources.files(__package__).joinpath("image-map.yaml").read_text(encoding="utf-8")


def parse(text: str, registry: str | None = None) -> dict[str, str]:
    """``{public name: registry name}`` from YAML ``text``; ``{registry}`` replaced by ``registry``.

    Raises :class:`ValidationError` (field ``imageMap`` or ``imageMap.<key>``) for anything but a
    mapping of non-empty strings, or a ``{registry}`` value when no registry is given."""
    data = safeyaml.load(text) or {}
    if not isinstance(data, dict):
        raise ValidationError("imageMap", "must be a mapping of public image name -> registry image name")
    out: dict[str, str] = {}
    for key, value in data.items():
        if not isinstance(key, str) or not isinstance(value, str) or not key or not value:
            raise ValidationError(f"imageMap.{key}", "keys and values must be non-empty strings")
        if "{registry}" in value:
            if not registry:
                raise ValidationError(f"imageMap.{key}", "names {registry} but the platform has no registry")
            value = value.replace("{registry}", registry)
        out[key] = value
    if registry:
        for key, value in CATALOGUE.items():
            out.setdefault(key, value.replace("{registry}", registry))
    return out


def load(path: Path | None, registry: str | None = None) -> dict[str, str]:
    """The map in ``path``, or the shipped defaults when ``path`` is ``None``."""
    return parse(path.read_text(encoding="utf-8") if path is not None else default_text(), registry)

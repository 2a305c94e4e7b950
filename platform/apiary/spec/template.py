"""Job templates (OpenPAI marketplace's shape): a described OpenPAI job whose parameters a user sets.

A template document (YAML or JSON, the body of ``POST /api/v2/templates`` and the files of
``examples/marketplace/templates/``)::

    name: mnist                      # like a job name: letters, digits, '_' and '-'
    summary: one line
    description: Markdown
    author: who wrote it
    tags: [mnist, training]
    visibility: {virtualClusters: [], groups: []}   # empty: everyone
    parameterSchema:                 # optional refinements, by parameter
      epochs: {title: Epochs, description: ..., minimum: 1, maximum: 100}
      checkpoint: {type: model}      # a registered model version NAME/VERSION
    job: |                           # OpenPAI job protocol v2 YAML, as text
      protocolVersion: 2
      name: mnist
      parameters: {epochs: 1}
      ...

Each top-level ``parameters:`` entry of ``job`` is one parameter of the template: its type is
derived from its value (``integer``, ``number``, ``boolean``, ``string``) and its value is the
default. ``parameterSchema`` refines a parameter: ``title``, ``description``, ``minimum`` and
``maximum`` (integer and number), ``enum``, and ``type``: ``number`` for an integer default, or
``model`` for a string default, which is then a registered model version ``NAME/VERSION`` that
:func:`render` resolves to a URI through the resolver it is given.

:func:`render` overlays a caller's values on the defaults and writes the job YAML that is
submitted; the job's ``<% $parameters.x %>`` references are substituted at submission by
:mod:`apiary.spec.templating`. Pure: no I/O; every failure is an
:class:`apiary.errors.ValidationError` naming the field (``parameters.epochs``, ``job``,
``parameterSchema.lr.minimum``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from apiary.errors import ForbiddenError, NotFoundError, ValidationError
from apiary.spec import safeyaml
from apiary.spec.job import JobSpec, parse_job

__all__ = [
    "MODEL_REF_RE",
    "NAME_MAX_LENGTH",
    "Parameter",
    "ParamType",
    "Template",
    "Visibility",
    "coerce_value",
    "job_name_for",
    "parse_template",
    "render",
    "split_assignments",
]

#: A parameter's type: the four a YAML scalar has, and ``model`` (a registered model version).
ParamType = Literal["integer", "number", "boolean", "string", "model"]

#: Template names: a job name's characters, at most 100 (a job name made from it gets a suffix).
NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,100}")
NAME_MAX_LENGTH = 100
#: Job names given to a run (``--name``): the protocol's job name rule (apiary.spec.job.NAME_PATTERN).
JOB_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,200}")
#: A model reference: ``NAME/VERSION`` (the model registry's name, a version number or alias).
MODEL_REF_RE = re.compile(r"[A-Za-z0-9_.-]{1,200}/[A-Za-z0-9_.-]{1,100}")
#: Longest summary (characters), description, author, tag and number of tags.
SUMMARY_MAX = 300
DESCRIPTION_MAX = 100_000
AUTHOR_MAX = 200
TAG_RE = re.compile(r"[A-Za-z0-9_.+-]{1,50}")
MAX_TAGS = 20
MAX_VISIBILITY = 100
#: Keys a ``parameterSchema`` entry may have.
SCHEMA_KEYS = ("type", "title", "description", "minimum", "maximum", "enum")
#: Keys of a template document.
DOC_KEYS = ("name", "summary", "description", "author", "tags", "visibility", "parameterSchema", "job", "official")

_TYPE_OF: dict[type, ParamType] = {bool: "boolean", int: "integer", float: "number", str: "string"}


@dataclass(frozen=True)
class Parameter:
    """One parameter of a template: ``name`` (the key under the job's ``parameters``), ``type``,
    ``default`` (of that type; for ``model`` the ``NAME/VERSION`` reference), and what the run
    form shows: ``title``, ``description``, ``minimum``/``maximum`` (inclusive, integer and
    number only), ``enum`` (the values allowed, or None)."""

    name: str
    type: ParamType
    default: Any
    title: str | None = None
    description: str | None = None
    minimum: float | None = None
    maximum: float | None = None
    enum: tuple[Any, ...] | None = None

    def json_schema(self) -> dict[str, Any]:
        """The parameter as a JSON Schema property (what the Prefect run form draws): ``type``
        (``model`` is a ``string`` with a ``NAME/VERSION`` pattern), ``default``, ``title``,
        ``description``, ``minimum``, ``maximum``, ``enum`` where set."""
        out: dict[str, Any] = {"type": "string" if self.type == "model" else self.type,
                               "title": self.title or self.name, "default": self.default}
        if self.type == "model":
            out["pattern"] = f"^{MODEL_REF_RE.pattern}$"
        described = self.description or ("A registered model version, NAME/VERSION." if self.type == "model"
                                          else None)
        if described:
            out["description"] = described
        if self.minimum is not None:
            out["minimum"] = self.minimum
        if self.maximum is not None:
            out["maximum"] = self.maximum
        if self.enum is not None:
            out["enum"] = list(self.enum)
        return out

    def to_json(self) -> dict[str, Any]:
        """``{name, type, default, title?, description?, minimum?, maximum?, enum?}``."""
        out: dict[str, Any] = {"name": self.name, "type": self.type, "default": self.default}
        for key in ("title", "description", "minimum", "maximum"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.enum is not None:
            out["enum"] = list(self.enum)
        return out


@dataclass(frozen=True)
class Visibility:
    """Who sees a template besides its owner and admins: users whose groups grant one of
    ``virtual_clusters`` or who are in one of ``groups``; both empty: everyone."""

    virtual_clusters: tuple[str, ...] = ()
    groups: tuple[str, ...] = ()

    @property
    def everyone(self) -> bool:
        return not self.virtual_clusters and not self.groups

    def admits(self, groups: frozenset[str], virtual_clusters: frozenset[str]) -> bool:
        """Whether a user in ``groups`` with ``virtual_clusters`` granted sees the template."""
        return (self.everyone or bool(groups & set(self.groups))
                or bool(virtual_clusters & set(self.virtual_clusters)))

    def to_json(self) -> dict[str, list[str]]:
        return {"virtualClusters": list(self.virtual_clusters), "groups": list(self.groups)}


@dataclass(frozen=True)
class Template:
    """A parsed, checked template (module doc). ``job`` is the job YAML text as published;
    ``job_name`` its ``name``; ``parameter_schema`` the refinements as given (kept to be stored);
    ``official`` whether an admin marked it so."""

    name: str
    summary: str
    description: str
    author: str
    tags: tuple[str, ...]
    visibility: Visibility
    job: str
    job_name: str
    parameters: tuple[Parameter, ...]
    parameter_schema: dict[str, dict[str, Any]] = field(default_factory=dict)
    official: bool = False

    def parameter(self, name: str) -> Parameter | None:
        return next((p for p in self.parameters if p.name == name), None)

    def document(self) -> dict[str, Any]:
        """The template document (module doc's keys; ``parameterSchema`` as given)."""
        return {"name": self.name, "summary": self.summary, "description": self.description,
                "author": self.author, "tags": list(self.tags), "visibility": self.visibility.to_json(),
                "parameterSchema": self.parameter_schema, "job": self.job, "official": self.official}

    def run_form_schema(self) -> dict[str, Any]:
        """A JSON Schema object of the parameters, in the job's order: one property each
        (:meth:`Parameter.json_schema`), none required (each has its default)."""
        return {"type": "object", "title": "Parameters",
                "properties": {p.name: p.json_schema() for p in self.parameters}}


# --------------------------------------------------------------------------- parsing
def _text(doc: Mapping[str, Any], key: str, limit: int, *, required: bool = False) -> str:
    value = doc.get(key)
    if value is None or value == "":
        if required:
            raise ValidationError(key, "is required")
        return ""
    if not isinstance(value, str):
        raise ValidationError(key, f"must be a string, got {type(value).__name__}")
    if len(value) > limit:
        raise ValidationError(key, f"is {len(value)} characters, more than {limit}")
    if "\x00" in value:
        raise ValidationError(key, "must not hold a NUL character")
    return value


def _names(value: Any, field: str, pattern: re.Pattern[str], limit: int, what: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > limit:
        raise ValidationError(field, f"must be a list of at most {limit} {what}")
    for i, item in enumerate(value):
        if not isinstance(item, str) or pattern.fullmatch(item) is None:
            raise ValidationError(f"{field}[{i}]", f"{item!r} is not a valid name (letters, digits, "
                                                   "'_', '-', '.'; at most 100 characters)")
    return tuple(dict.fromkeys(value))


_GROUP_RE = re.compile(r"[A-Za-z0-9_.-]{1,100}")


def _visibility(value: Any) -> Visibility:
    if value is None:
        return Visibility()
    if not isinstance(value, Mapping):
        raise ValidationError("visibility", "must be a mapping {virtualClusters: [...], groups: [...]}")
    unknown = sorted(set(value) - {"virtualClusters", "groups"})
    if unknown:
        raise ValidationError(f"visibility.{unknown[0]}", "unknown field; visibility has virtualClusters and groups")
    return Visibility(_names(value.get("virtualClusters"), "visibility.virtualClusters", _GROUP_RE, MAX_VISIBILITY,
                             "virtual clusters"),
                      _names(value.get("groups"), "visibility.groups", _GROUP_RE, MAX_VISIBILITY, "groups"))


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _parameter(name: str, default: Any, refine: Any) -> Parameter:
    field = f"parameters.{name}"
    base = _TYPE_OF.get(type(default))
    if base is None or (base == "number" and not math.isfinite(default)):
        raise ValidationError(f"job.{field}", f"{default!r}: a template's parameter must be an integer, a number, "
                                              "a boolean or a string (its default)")
    if refine is None:
        refine = {}
    where = f"parameterSchema.{name}"
    if not isinstance(refine, Mapping):
        raise ValidationError(where, "must be a mapping {type, title, description, minimum, maximum, enum}")
    unknown = sorted(set(refine) - set(SCHEMA_KEYS))
    if unknown:
        raise ValidationError(f"{where}.{unknown[0]}", f"unknown field; one of {', '.join(SCHEMA_KEYS)}")
    kind: ParamType = base
    wanted = refine.get("type", base)
    if wanted != base:
        if wanted == "number" and base == "integer":
            kind = "number"
        elif wanted == "model" and base == "string":
            kind = "model"
        else:
            raise ValidationError(f"{where}.type", f"{wanted!r} does not fit the default {default!r} ({base}); a "
                                                   "type may widen an integer to number or make a string a model")
    title = _opt_str(refine.get("title"), f"{where}.title", 200)
    description = _opt_str(refine.get("description"), f"{where}.description", 2000)
    bounds: dict[str, float | None] = {}
    for key in ("minimum", "maximum"):
        value = refine.get(key)
        if value is not None and (kind not in ("integer", "number") or not _is_number(value)):
            raise ValidationError(f"{where}.{key}", "is a number, for integer and number parameters only")
        bounds[key] = value
    if bounds["minimum"] is not None and bounds["maximum"] is not None and bounds["minimum"] > bounds["maximum"]:
        raise ValidationError(f"{where}.minimum", f"{bounds['minimum']} is more than maximum {bounds['maximum']}")
    enum: tuple[Any, ...] | None = None
    if refine.get("enum") is not None:
        raw = refine["enum"]
        if not isinstance(raw, list) or not raw or len(raw) > 100:
            raise ValidationError(f"{where}.enum", "must be a non-empty list of at most 100 values")
        bare = Parameter(name, kind, default)
        enum = tuple(coerce_value(bare, v, f"{where}.enum[{i}]") for i, v in enumerate(raw))
    param = Parameter(name, kind, default, title, description, bounds["minimum"], bounds["maximum"], enum)
    coerce_value(param, default, f"job.{field}")  # the default must meet its own constraints
    return param


def _opt_str(value: Any, field: str, limit: int) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > limit:
        raise ValidationError(field, f"must be a string of at most {limit} characters")
    return value


def _job_doc(text: str) -> dict[str, Any]:
    data = safeyaml.load(text, field="job", what="template job")
    if not isinstance(data, dict):
        raise ValidationError("job", f"must be an OpenPAI job YAML mapping, got {type(data).__name__}")
    return data


def _checked_job(text: str) -> JobSpec:
    try:
        return parse_job(text)
    except ValidationError as e:
        raise ValidationError(f"job.{e.field}" if e.field and e.field != "body" else "job", e.reason) from None


def parse_template(doc: Any) -> Template:
    """Check a template document (a mapping, or its YAML/JSON text) and return the template.

    ``job`` must be text that :func:`apiary.spec.job.parse_job` accepts with its parameters'
    defaults (so a published template runs as it stands); a job given as a mapping is taken as
    its YAML. Raises ValidationError: ``name``, ``summary``, ``tags[i]``, ``visibility.groups[i]``,
    ``parameterSchema.<p>.<key>`` (or ``parameterSchema.<p>`` for a parameter the job lacks),
    ``job`` (not a job), ``job.<field>`` (the job's own error), ``job.parameters.<p>`` (not a
    scalar, or a default outside its constraints).
    """
    if isinstance(doc, str | bytes):
        doc = safeyaml.load(doc, field="body", what="template")
    if not isinstance(doc, Mapping):
        raise ValidationError("body", f"a template must be a mapping, got {type(doc).__name__}")
    unknown = sorted(set(doc) - set(DOC_KEYS))
    if unknown:
        raise ValidationError(unknown[0], f"unknown field; a template has {', '.join(DOC_KEYS)}")
    name = doc.get("name")
    if not isinstance(name, str) or NAME_RE.fullmatch(name) is None:
        raise ValidationError("name", f"{name!r} must be 1-{NAME_MAX_LENGTH} letters, digits, '_' or '-'")
    job = doc.get("job")
    if isinstance(job, Mapping):
        job = yaml.safe_dump(dict(job), sort_keys=False)
    if not isinstance(job, str) or not job.strip():
        raise ValidationError("job", "is required: an OpenPAI job protocol v2 YAML (text)")
    data = _job_doc(job)
    spec = _checked_job(job)
    params = data.get("parameters") or {}
    if not isinstance(params, dict):
        raise ValidationError("job.parameters", "must be a mapping of parameter names to default values")
    schema = doc.get("parameterSchema") or {}
    if not isinstance(schema, Mapping):
        raise ValidationError("parameterSchema", "must be a mapping of parameter names to refinements")
    for key in schema:
        if key not in params:
            known = ", ".join(params) or "none"
            raise ValidationError(f"parameterSchema.{key}", f"the job has no parameter {key!r} (parameters: {known})")
    parameters = tuple(_parameter(str(k), v, schema.get(k)) for k, v in params.items())
    official = doc.get("official", False)
    if not isinstance(official, bool):
        raise ValidationError("official", "must be true or false")
    return Template(
        name=name, summary=_text(doc, "summary", SUMMARY_MAX), description=_text(doc, "description", DESCRIPTION_MAX),
        author=_text(doc, "author", AUTHOR_MAX), tags=_names(doc.get("tags"), "tags", TAG_RE, MAX_TAGS, "tags"),
        visibility=_visibility(doc.get("visibility")), job=job, job_name=spec.name, parameters=parameters,
        parameter_schema={str(k): dict(v) for k, v in schema.items()}, official=official,
    )


# --------------------------------------------------------------------------- values and rendering
def coerce_value(param: Parameter, value: Any, field: str) -> Any:
    """``value`` as ``param``'s type, checked against its minimum, maximum and enum.

    Text is read as the type (what ``-p epochs=3`` on the command line gives): ``"3"`` for an
    integer, ``"0.1"`` for a number, ``true``/``false`` (also ``1``/``0``, ``yes``/``no``) for a
    boolean. A model value must be ``NAME/VERSION``. Raises ValidationError naming ``field``.
    """
    kind = param.type
    out: Any
    if kind == "boolean":
        if isinstance(value, bool):
            out = value
        elif isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            out = value.lower() in ("true", "1", "yes")
        else:
            raise ValidationError(field, f"{value!r} is not a boolean (true or false)")
    elif kind == "integer":
        if isinstance(value, int) and not isinstance(value, bool):
            out = value
        elif isinstance(value, float) and value.is_integer():
            out = int(value)
        elif isinstance(value, str) and re.fullmatch(r"[+-]?\d{1,18}", value.strip()):
            out = int(value)
        else:
            raise ValidationError(field, f"{value!r} is not an integer")
    elif kind == "number":
        if _is_number(value):
            out = value
        else:
            try:
                out = float(value) if isinstance(value, str) else None
            except ValueError:
                out = None
            if out is None or not math.isfinite(out):
                raise ValidationError(field, f"{value!r} is not a number")
    else:  # string, model
        if not isinstance(value, str):
            raise ValidationError(field, f"{value!r} is not a string")
        if "\x00" in value or len(value) > 10_000:
            raise ValidationError(field, "must be at most 10,000 characters without NUL")
        if kind == "model" and MODEL_REF_RE.fullmatch(value) is None:
            raise ValidationError(field, f"{value!r} is not a registered model version NAME/VERSION (e.g. mnist/1)")
        out = value
    if param.minimum is not None and out < param.minimum:
        raise ValidationError(field, f"{out} is less than the minimum {param.minimum}")
    if param.maximum is not None and out > param.maximum:
        raise ValidationError(field, f"{out} is more than the maximum {param.maximum}")
    if param.enum is not None and out not in param.enum:
        raise ValidationError(field, f"{out!r} is not one of {', '.join(map(repr, param.enum))}")
    return out


def job_name_for(template: Template, suffix: str, job_name: str | None = None) -> str:
    """The submitted job's name: ``job_name`` when given (checked: letters, digits, '_', '-'),
    else the template job's name, ``-`` and ``suffix`` (cut to fit 200 characters). Raises
    ValidationError ``name``."""
    if job_name is not None:
        if JOB_NAME_RE.fullmatch(job_name) is None:
            raise ValidationError("name", f"{job_name!r} must be 1-200 letters, digits, '_' or '-'")
        return job_name
    return f"{template.job_name[:200 - len(suffix) - 1]}-{suffix}"


def render(template: Template, values: Mapping[str, Any] | None, *, suffix: str, job_name: str | None = None,
           virtual_cluster: str | None = None, resolve: Callable[[str], str] | None = None) -> str:
    """The job YAML a run of ``template`` submits: its job with ``parameters`` set to the defaults
    overlaid with ``values`` (each coerced by :func:`coerce_value`), ``name`` from
    :func:`job_name_for` (``suffix``: a few characters the caller draws, this module has no
    randomness), and ``defaults.virtualCluster`` replaced when ``virtual_cluster`` is given.

    A ``model`` parameter's ``NAME/VERSION`` (given or default) is replaced by ``resolve(ref)``,
    the model version's URI; ``resolve`` None is a ValidationError ``parameters.<p>`` ("no model
    registry"), and a NotFoundError or ForbiddenError ``resolve`` raises (a version that does not
    exist or the caller may not read) is raised again, same class, with ``parameters.<p>:`` first.

    Raises ValidationError: ``parameters.<p>`` for an unknown parameter (the message lists the
    known ones) or a value of the wrong type or out of bounds; ``name``; ``virtualCluster``.
    """
    values = dict(values or {})
    for key in values:
        if template.parameter(key) is None:
            known = ", ".join(p.name for p in template.parameters) or "none"
            raise ValidationError(f"parameters.{key}", f"template {template.name} has no parameter {key!r} "
                                                       f"(parameters: {known})")
    doc = _job_doc(template.job)
    merged: dict[str, Any] = dict(doc.get("parameters") or {})
    for p in template.parameters:
        field = f"parameters.{p.name}"
        value = coerce_value(p, values[p.name], field) if p.name in values else p.default
        if p.type == "model":
            if resolve is None:
                raise ValidationError(field, "no model registry: this platform cannot resolve model versions, so "
                                             f"template {template.name} cannot run here")
            try:
                value = resolve(value)
            except (NotFoundError, ForbiddenError) as e:  # the registry's answer, with the parameter named
                raise type(e)(f"{field}: {e.message}") from e
        merged[p.name] = value
    if merged:
        doc["parameters"] = merged
    doc["name"] = job_name_for(template, suffix, job_name)
    if virtual_cluster is not None:
        if _GROUP_RE.fullmatch(virtual_cluster) is None:
            raise ValidationError("virtualCluster", f"{virtual_cluster!r} is not a virtual cluster name")
        defaults = doc.get("defaults")
        doc["defaults"] = {**(defaults if isinstance(defaults, dict) else {}), "virtualCluster": virtual_cluster}
    return yaml.safe_dump(doc, sort_keys=False, allow_unicode=True)


def split_assignments(items: Sequence[str], field: str = "parameters") -> dict[str, str]:
    """``["epochs=3", "lr=0.1"]`` -> ``{"epochs": "3", "lr": "0.1"}`` (the CLI's ``-p``); the value
    may hold ``=``. Raises ValidationError ``field`` for an item without ``=`` or a repeated key."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValidationError(field, f"{item!r} is not NAME=VALUE")
        if key in out:
            raise ValidationError(f"{field}.{key}", "given twice")
        out[key] = value
    return out

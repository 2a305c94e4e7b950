"""Job templates in the store: publish, curate, list, run (OpenPAI marketplace's templates).

A template (:mod:`apiary.spec.template`) is a row of ``job_templates``. Who may do what:

* **users** publish (they own what they publish) and update or delete their own;
* **admins** update or delete any, and alone set ``official`` (the platform's curated ones);
* a template's **visibility** (virtual clusters and/or groups; empty: everyone) filters list, get
  and run: a user who is not its owner, not an admin and neither in one of its groups nor granted
  one of its virtual clusters gets 404 (no hint that it exists). The Prefect bridge sees every
  template (it serves their run forms); a run it makes on behalf of a user is checked for that user.

A run renders the template with the caller's values (:func:`apiary.spec.template.render`) and
submits the job **as the caller** through the submission the service is given: the API passes the
path of ``POST /api/v2/jobs`` (rate limit, VC grants, storage grants, the plane's group commit), so
a template grants nothing a plain job would not. Every write goes through the unit of work.
"""

from __future__ import annotations

import builtins
import logging
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from sqlalchemy import select

from apiary.auth import Principal
from apiary.errors import ConflictError, ForbiddenError, NotFoundError, UnavailableError, ValidationError
from apiary.spec import safeyaml
from apiary.spec.template import Template, Visibility, parse_template, render
from apiary.store.models import JobTemplate
from apiary.store.unit import Sessions, UnitOfWork, reading

logger = logging.getLogger(__name__)

__all__ = ["ModelResolver", "NoTemplateError", "Submit", "TemplateService", "load_template_files", "sees"]

#: Resolves a registered model version ``NAME/VERSION`` for a principal to its URI; raises
#: NotFoundError (404) for a version that does not exist or ForbiddenError for one it may not read.
ModelResolver = Callable[[str, Principal], str]
#: Submits job YAML text as a user: ``(text, who, flow_run_id) -> the job's JSON``; raises what
#: ``POST /api/v2/jobs`` raises (ValidationError, ForbiddenError, ConflictError, TooManyRequestsError).
Submit = Callable[[str, Principal, str | None], dict]


class NoTemplateError(NotFoundError):
    """No template of that name, or none the caller may see. HTTP 404."""

    code = "NoTemplateError"


def _template(row: JobTemplate) -> Template:
    doc = {"name": row.name, "summary": row.summary, "description": row.description, "author": row.author,
           "tags": list(row.tags or []), "visibility": dict(row.visibility or {}),
           "parameterSchema": dict(row.parameter_schema or {}), "job": row.job_yaml, "official": bool(row.official)}
    return parse_template(doc)


def _json(row: JobTemplate, template: Template) -> dict[str, Any]:
    return {"name": row.name, "owner": row.owner, "official": bool(row.official), "summary": template.summary,
            "description": template.description, "author": template.author, "tags": list(template.tags),
            "visibility": template.visibility.to_json(), "jobName": template.job_name,
            "parameters": [p.to_json() for p in template.parameters],
            "parameterSchema": template.parameter_schema, "job": template.job,
            "created": row.created, "updated": row.updated}


def sees(principal: Principal, owner: str, visibility: Visibility) -> bool:
    """Whether ``principal`` may see (and run) a template of ``owner`` with ``visibility``."""
    if principal.admin or principal.is_bridge:
        return True
    if principal.kind != "user":
        return False
    return principal.name == owner or visibility.admits(principal.groups, principal.virtual_clusters)


class TemplateService:
    """Job templates (module doc). Thread-safe: every call opens its own session.

    ``submit``: how a run submits its job (None: :meth:`run` answers 503); ``resolver``: the model
    registry's :data:`ModelResolver` (None: a template with a ``model`` parameter cannot run, 400
    "no model registry"); both may be set after construction. ``suffix``: the few characters that
    make a run's job name unique (default 6 random hex digits).

    Raises, besides what each method names: ValidationError (400, naming the field),
    NoTemplateError (404), ForbiddenError (403), ConflictError (409) and the store's
    UnavailableError (503).
    """

    def __init__(self, sessions: Sessions, *, submit: Submit | None = None, resolver: ModelResolver | None = None,
                 clock: Callable[[], float] = time.time, suffix: Callable[[], str] = lambda: secrets.token_hex(3)
                 ) -> None:
        self._sessions = sessions
        self.submit = submit
        self.resolver = resolver
        self._clock = clock
        self._suffix = suffix

    # ------------------------------------------------------------------ reads
    def _visible_row(self, s: Any, name: str, principal: Principal) -> tuple[JobTemplate, Template]:
        row = s.get(JobTemplate, name)
        if row is None:
            raise NoTemplateError(f"Template {name} not found.")
        template = _template(row)
        if not sees(principal, row.owner, template.visibility):
            raise NoTemplateError(f"Template {name} not found.")
        return row, template

    def list(self, principal: Principal, *, q: str | None = None, tag: str | None = None) -> list[dict]:
        """The templates ``principal`` sees, official first, then by name. ``q``: a case-insensitive
        substring of the name, the summary or a tag; ``tag``: one of its tags exactly. Each as
        :meth:`get` answers it."""
        needle = (q or "").strip().lower()
        out: list[tuple[bool, str, dict]] = []
        with reading(self._sessions, "list templates") as s:
            for row in s.scalars(select(JobTemplate)):
                template = _template(row)
                if not sees(principal, row.owner, template.visibility):
                    continue
                if tag and tag not in template.tags:
                    continue
                if needle and not (needle in row.name.lower() or needle in template.summary.lower()
                                   or any(needle in t.lower() for t in template.tags)):
                    continue
                out.append((not row.official, row.name, _json(row, template)))
        return [j for _, _, j in sorted(out, key=lambda item: (item[0], item[1]))]

    def get(self, name: str, principal: Principal) -> dict:
        """``{name, owner, official, summary, description, author, tags, visibility, jobName,
        parameters: [{name, type, default, title?, ...}], parameterSchema, job, created, updated}``
        (times: unix seconds). Raises NoTemplateError (also for one ``principal`` may not see)."""
        with reading(self._sessions, "read template") as s:
            row, template = self._visible_row(s, name, principal)
            return _json(row, template)

    def template(self, name: str, principal: Principal) -> Template:
        """The parsed template ``name`` as ``principal`` sees it (NoTemplateError otherwise)."""
        with reading(self._sessions, "read template") as s:
            return self._visible_row(s, name, principal)[1]

    # ------------------------------------------------------------------ writes
    def publish(self, doc: Mapping[str, Any], principal: Principal) -> dict:
        """Publish ``doc`` (a template document, :mod:`apiary.spec.template`) owned by
        ``principal``. ``official: true`` only from an admin (403). Raises ValidationError for a bad
        document and ConflictError when the name is taken. Returns it as :meth:`get` does."""
        template = parse_template(doc)
        self._check_official(template.official, principal, template.name)
        now = self._clock()
        with UnitOfWork(self._sessions, "publish template") as uow:
            if uow.s.get(JobTemplate, template.name) is not None:
                raise ConflictError(f"Template {template.name} exists already; its owner or an admin may update it "
                                    f"(PUT /api/v2/templates/{template.name}).")
            uow.s.add(self._row(JobTemplate(name=template.name, owner=principal.name, created=now), template, now))
        logger.info("template published name=%s owner=%s official=%s", template.name, principal.name,
                    template.official)
        return self.get(template.name, principal)

    def update(self, name: str, doc: Mapping[str, Any], principal: Principal) -> dict:
        """Replace template ``name`` with ``doc`` (its ``name`` must be ``name`` or absent); its
        owner or an admin only (403), and ``official`` changed by an admin only. Without
        ``official`` in ``doc`` the template keeps its flag. Raises NoTemplateError for one
        ``principal`` may not see, ValidationError for a bad document."""
        if doc.get("name", name) != name:
            raise ValidationError("name", f"{doc.get('name')!r} is not the template's name {name!r}: a template "
                                          "is not renamed (publish a new one and delete this)")
        with UnitOfWork(self._sessions, "update template") as uow:
            row, current = self._visible_row(uow.s, name, principal)
            self._check_owner(row, principal, "update")
            template = parse_template({**doc, "name": name, "official": doc.get("official", current.official)})
            if template.official != current.official:
                self._check_official(True, principal, name)
            self._row(row, template, self._clock())
        return self.get(name, principal)

    def delete(self, name: str, principal: Principal) -> None:
        """Delete template ``name``: its owner or an admin (403); NoTemplateError for one
        ``principal`` may not see."""
        with UnitOfWork(self._sessions, "delete template") as uow:
            row, _ = self._visible_row(uow.s, name, principal)
            self._check_owner(row, principal, "delete")
            uow.s.delete(row)
        logger.info("template deleted name=%s by=%s", name, principal.name)

    def seed(self, docs: Iterable[Mapping[str, Any]], owner: str) -> builtins.list[str]:
        """Publish each of ``docs`` as official, owned by ``owner`` (an admin), unless a template of
        its name exists (left as it is). Returns the names published. Raises ValidationError for a
        bad document (a shipped template is a platform error to fix, not to skip)."""
        published = []
        now = self._clock()
        with UnitOfWork(self._sessions, "seed templates") as uow:
            for doc in docs:
                template = parse_template({**doc, "official": True})
                if uow.s.get(JobTemplate, template.name) is None:
                    uow.s.add(self._row(JobTemplate(name=template.name, owner=owner, created=now), template, now))
                    published.append(template.name)
        return published

    @staticmethod
    def _row(row: JobTemplate, template: Template, now: float) -> JobTemplate:
        row.summary, row.description, row.author = template.summary, template.description, template.author
        row.tags, row.visibility = list(template.tags), template.visibility.to_json()
        row.parameter_schema, row.job_yaml = template.parameter_schema, template.job
        row.official, row.updated = template.official, now
        return row

    @staticmethod
    def _check_owner(row: JobTemplate, principal: Principal, what: str) -> None:
        if not (principal.admin or (principal.kind == "user" and principal.name == row.owner)):
            raise ForbiddenError(f"Only {row.owner} and admins may {what} template {row.name}; you are "
                                 f"{principal.describe()}.")

    @staticmethod
    def _check_official(official: bool, principal: Principal, name: str) -> None:
        if official and not principal.admin:
            raise ForbiddenError(f"Only admins may mark template {name} official; you are {principal.describe()}.")

    # ------------------------------------------------------------------ runs
    def render_run(self, name: str, values: Mapping[str, Any] | None, principal: Principal, *,
                   job_name: str | None = None, virtual_cluster: str | None = None) -> str:
        """The job YAML a run of template ``name`` by ``principal`` submits (see
        :func:`apiary.spec.template.render`; model parameters resolved for ``principal``).
        Raises NoTemplateError for a template ``principal`` may not see, ValidationError naming
        the parameter, and what the resolver raises."""
        template = self.template(name, principal)
        resolver = self.resolver
        resolve = (lambda ref: resolver(ref, principal)) if resolver is not None else None
        return render(template, values, suffix=self._suffix(), job_name=job_name, virtual_cluster=virtual_cluster,
                      resolve=resolve)

    def run(self, name: str, values: Mapping[str, Any] | None, principal: Principal, job_name: str | None = None,
            *, virtual_cluster: str | None = None, flow_run_id: str | None = None) -> dict:
        """Render template ``name`` with ``values`` and submit the job as ``principal`` (the user
        it belongs to) through :attr:`submit`, attached to ``flow_run_id`` when given. Returns the
        submitted job's JSON (``POST /api/v2/jobs``' answer). Raises what :meth:`render_run` and the
        submission raise (a VC the user is not granted: 403; a taken job name: 409)."""
        if self.submit is None:
            raise UnavailableError("This process submits no jobs (no submission path was wired).")
        text = self.render_run(name, values, principal, job_name=job_name, virtual_cluster=virtual_cluster)
        job = self.submit(text, principal, flow_run_id)
        logger.info("template run name=%s user=%s job=%s", name, principal.name, job.get("id"))
        return job


def load_template_files(directory: Path) -> list[dict[str, Any]]:
    """The template documents of ``directory/*.yaml``, by file name (each a YAML mapping, read with
    the bounded loader). Raises ValidationError naming the file for one that is not a mapping."""
    docs = []
    for path in sorted(directory.glob("*.yaml")):
        doc = safeyaml.load(path.read_bytes(), field=path.name, what="template")
        if not isinstance(doc, dict):
            raise ValidationError(path.name, "a template file must be a YAML mapping")
        docs.append(doc)
    return docs

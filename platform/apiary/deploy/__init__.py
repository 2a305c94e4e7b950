"""Deploying Apiary to Kubernetes: ``apiary deploy render`` writes the platform's manifests.

:func:`render` loads a values file (:class:`Values`; the documented defaults are
``deploy/kubernetes/values.yaml``), renders the Jinja2 templates shipped in this package
(``templates/*.yaml.j2``) and writes one file per manifest. See ``deploy/kubernetes/README.md``.
"""

from __future__ import annotations

from apiary.deploy.render import Values, load_values, render

__all__ = ["Values", "load_values", "render"]

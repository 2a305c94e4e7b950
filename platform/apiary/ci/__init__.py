"""Apiary's own CI/CD (issue "CI/CD path as Prefect flows"): GitHub's webhook deliveries in, Prefect
flow runs out, the pipeline's stages, the staging and production platforms.

* :mod:`apiary.ci.webhooks`: pure: the signature check and what a delivery asks for.
* :mod:`apiary.ci.starter`: the :class:`~apiary.ci.starter.PipelineStarter` interface and its
  Prefect implementation.
* :mod:`apiary.ci.intake`: the delivery record in the store (``ci_deliveries``, the truth) and the
  background start.
* :mod:`apiary.ci.pipeline`, :mod:`apiary.ci.stages`, :mod:`apiary.ci.config`: ``platform-ci``.
* :mod:`apiary.ci.run`: one commit's pipeline with its records; the deploy gate and rollout call.
* :mod:`apiary.ci.containers`, :mod:`apiary.ci.rollout`: platforms of containers, gated rollouts.
* :mod:`apiary.ci.records`: pipeline runs and deployments in the store.
* :mod:`apiary.ci.entry`: ``ci/run-pipeline`` and ``ci/deploy`` (Jenkins).
"""

"""Apiary's own CI/CD: GitHub's webhook deliveries in, Prefect flow runs out, the pipeline's stages,
the staging and production platforms. A delivery, its pipeline run and its deployment are one CI
record in the store (``ci_records``) whose state advances.

* :mod:`apiary.ci.webhooks`: pure: the signature check and what a delivery asks for.
* :mod:`apiary.ci.starter`: the :class:`~apiary.ci.starter.PipelineStarter` interface and its
  Prefect implementation.
* :mod:`apiary.ci.intake`: a delivery's record in the store (the truth) and the background start.
* :mod:`apiary.ci.pipeline`, :mod:`apiary.ci.stages`, :mod:`apiary.ci.config`: ``platform-ci``.
* :mod:`apiary.ci.run`: one commit's pipeline with its records; the deploy gate and rollout call.
* :mod:`apiary.ci.containers`, :mod:`apiary.ci.rollout`: platforms of containers, gated rollouts.
* :mod:`apiary.ci.records`: the CI records (runs and deployments onto them) in the store.
* :mod:`apiary.ci.paired`: pure: the regression stage's judgement of a change against its base.
* :mod:`apiary.ci.entry`: ``ci/run-pipeline`` and ``ci/deploy`` (Jenkins).
"""

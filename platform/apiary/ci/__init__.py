"""CI/CD intake: GitHub's webhook deliveries in, Prefect flow runs out (issue "CI/CD path as Prefect flows").

* :mod:`apiary.ci.webhooks`: pure: the signature check and what a delivery asks for.
* :mod:`apiary.ci.starter`: the :class:`~apiary.ci.starter.PipelineStarter` interface and its
  Prefect implementation.
* :mod:`apiary.ci.intake`: the delivery record in the store (``ci_deliveries``, the truth) and the
  background start.
"""

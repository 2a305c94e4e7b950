"""Prefect integration: Apiary runs jobs itself; Prefect mirrors them.

* :mod:`apiary.tracking.prefect_server`: start/stop a local ``prefect server`` (tests, ``apiary up``);
* :mod:`apiary.tracking.source`: how the bridge reads Apiary (REST client, in-memory test double);
* :mod:`apiary.tracking.bridge`: :class:`~apiary.tracking.bridge.PrefectBridge`, one flow run per job: its
  event reader (:mod:`~apiary.tracking.events`), state table (:mod:`~apiary.tracking.states`),
  recorder (:mod:`~apiary.tracking.recorder`), state file (:mod:`~apiary.tracking.ledger`) and
  Prefect writes (:mod:`~apiary.tracking.flowruns`, :mod:`~apiary.tracking.transient`);
* :mod:`apiary.tracking.submit`: submit-and-wait, the body of the ``apiary-job`` flow.

Submodules are imported on use so that ``import apiary.tracking`` does not import Prefect.
"""

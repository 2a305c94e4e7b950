"""Load tests of a running platform: Locust (run as a subprocess, never imported here) driven by
:mod:`apiary.load.runner`, judged by the gate files of :mod:`apiary.load.gates`, with the profiles of
:mod:`apiary.load.profiles`, plots (:mod:`apiary.load.plots`) and Prefect artifacts
(:mod:`apiary.load.report`). The locustfiles live in ``loadtests/`` at the repository root.

The entry point for other code (``apiary load run``, the chaos drills)::

    from apiary.load.runner import run_load
    result = run_load(api_url, admin_token, profile="steady")   # -> LoadResult
    result.passed, result.rows, result.endpoints, result.jobs
"""

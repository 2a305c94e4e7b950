"""Drills: scheduled checks that the platform still does what it promises (AI-System 7.6.3.3).

=================  ============================================  =======================================
drill              what                                          module
=================  ============================================  =======================================
``inspection``     a tiny opportunistic job per VC, submit ->    :mod:`apiary.drills.inspection`
                   running -> succeeded against an SLO
``stress-drill``   a benchmark job on every node, diagnosed by   :mod:`apiary.drills.stress`,
                   SuperBench-style rules; failed nodes are      :mod:`apiary.drills.diagnosis`
                   reported and cordoned                         (``rules.yaml``)
``chaos-drill``    the chaos experiments tagged for drills,      :mod:`apiary.drills.live`
                   under the steady-state guard                  (:mod:`apiary.drills.guard`)
``load-drill``     a load profile, under the guard               :mod:`apiary.drills.live`
=================  ============================================  =======================================

:mod:`apiary.drills.run` has one entry point per drill (what the Prefect flows in
``flows/drills.py`` and ``python -m apiary.drills`` call). Every run reports its result to the
control plane (``POST /api/v2/drills/results``), which keeps it in a :class:`~apiary.drills.board.
DrillBoard` and shows it in ``/metrics`` (``apiary_probe_*``, ``apiary_drill_*``). Nothing here is
imported by this package's ``__init__``: the control plane imports only the board.
"""

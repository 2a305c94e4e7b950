"""Apiary on many hosts: every component on its own host (:mod:`.deployment`), the hosts being
network namespaces (:mod:`apiary.hosts`) in tests and drills, or real machines (README, "Running on
many machines", gives the same commands in order)."""

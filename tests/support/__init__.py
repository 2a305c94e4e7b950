"""Test support shared across the suite: builders for test inputs and polling helpers.

Import as ``from tests.support.builders import job_text`` (pytest runs with ``pythonpath = ["."]``).
Nothing here is product code: ``apiary`` never imports it.
"""

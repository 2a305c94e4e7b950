"""Demonstrations (``apiary demo ...``)."""

"""The REST API (FastAPI): OpenPAI-shaped job routes, node-agent routes, scheduler routes."""

from apiary.api.app import create_app

__all__ = ["create_app"]

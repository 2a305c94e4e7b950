"""The store's PostgreSQL fixtures (a private server for the ``postgres``-marked tests), for the
bootstrap tokens' race tests."""

from tests.store.conftest import pg_url, postgres_url

__all__ = ["pg_url", "postgres_url"]

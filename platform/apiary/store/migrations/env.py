"""Alembic environment: runs on the connection handed in by :func:`apiary.store.engine.migrate`,
or on ``sqlalchemy.url`` when invoked through the alembic CLI."""

from alembic import context
from sqlalchemy import create_engine

from apiary.store.models import Base

target_metadata = Base.metadata
config = context.config

connection = config.attributes.get("connection")
if connection is None:  # alembic CLI
    url = config.get_main_option("sqlalchemy.url")
    if not url:
        raise SystemExit("alembic: set sqlalchemy.url (the store's URL, e.g. sqlite:///home/apiary.db)")
    engine = create_engine(url)
    with engine.begin() as connection:
        context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
        context.run_migrations()
else:
    context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()

"""ci_deliveries.body_sha256: a replayed webhook body is a duplicate whatever its delivery id

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-28 02:00:00

GitHub's signature covers the body only, so the intake keeps each delivery's body SHA-256 and a
unique index on (event, body_sha256) recognises the same signed body under a new X-GitHub-Delivery
(apiary.ci.intake). Rows recorded before this revision have none (NULL: never equal, never a duplicate).
"""

import sqlalchemy as sa
from alembic import op

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('ci_deliveries', sa.Column('body_sha256', sa.String(length=64), nullable=True))
    op.create_index('ux_ci_deliveries_event_body', 'ci_deliveries', ['event', 'body_sha256'], unique=True)


def downgrade() -> None:
    op.drop_index('ux_ci_deliveries_event_body', table_name='ci_deliveries')
    with op.batch_alter_table('ci_deliveries') as batch:
        batch.drop_column('body_sha256')

"""incidents, their timelines, escalations, notifications and postmortem action items

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-26 10:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'incidents',
        sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
        sa.Column('title', sa.String(length=500), nullable=False),
        sa.Column('severity', sa.String(length=8), nullable=False),
        sa.Column('dedup_key', sa.String(length=255), nullable=False),
        sa.Column('state', sa.String(length=16), nullable=False),
        sa.Column('opened_at', sa.Float(), nullable=False),
        sa.Column('updated_at', sa.Float(), nullable=False),
        sa.Column('policy', sa.String(length=100), nullable=True),
        sa.Column('links', sa.JSON(), nullable=False),
        sa.Column('fingerprints', sa.JSON(), nullable=False),
        sa.Column('verdict', sa.String(length=16), nullable=True),
        sa.Column('postmortem', sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_incidents_dedup_key', 'incidents', ['dedup_key'])
    op.create_index('ix_incidents_state', 'incidents', ['state'])
    op.create_index('ix_incidents_opened_at', 'incidents', ['opened_at'])
    op.create_table(
        'incident_entries',
        sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
        sa.Column('incident_id', sa.Integer(), sa.ForeignKey('incidents.id'), nullable=False),
        sa.Column('seq', sa.Integer(), nullable=False),
        sa.Column('at', sa.Float(), nullable=False),
        sa.Column('actor', sa.String(length=200), nullable=False),
        sa.Column('kind', sa.String(length=32), nullable=False),
        sa.Column('event', sa.String(length=32), nullable=False),
        sa.Column('from_state', sa.String(length=16), nullable=True),
        sa.Column('to_state', sa.String(length=16), nullable=False),
        sa.Column('detail', sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint('id'),
        sa.UniqueConstraint('incident_id', 'seq'),
    )
    op.create_index('ix_incident_entries_incident_id', 'incident_entries', ['incident_id'])
    op.create_table(
        'escalations',
        sa.Column('incident_id', sa.Integer(), sa.ForeignKey('incidents.id'), nullable=False),
        sa.Column('policy', sa.String(length=100), nullable=False),
        sa.Column('started_at', sa.Float(), nullable=False),
        sa.Column('acknowledged_at', sa.Float(), nullable=True),
        sa.Column('next_at', sa.Float(), nullable=True),
        sa.Column('pages_sent', sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint('incident_id'),
    )
    op.create_index('ix_escalations_next_at', 'escalations', ['next_at'])
    op.create_table(
        'incident_notifications',
        sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
        sa.Column('incident_id', sa.Integer(), sa.ForeignKey('incidents.id'), nullable=False),
        sa.Column('at', sa.Float(), nullable=False),
        sa.Column('channel', sa.String(length=32), nullable=False),
        sa.Column('recipient', sa.String(length=200), nullable=False),
        sa.Column('attempt', sa.Integer(), nullable=False),
        sa.Column('ok', sa.Boolean(), nullable=False),
        sa.Column('detail', sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_incident_notifications_incident_id', 'incident_notifications', ['incident_id'])
    op.create_table(
        'incident_action_items',
        sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
        sa.Column('incident_id', sa.Integer(), sa.ForeignKey('incidents.id'), nullable=False),
        sa.Column('key', sa.String(length=32), nullable=False),
        sa.Column('text', sa.Text(), nullable=False),
        sa.Column('owner', sa.String(length=200), nullable=True),
        sa.Column('status', sa.String(length=16), nullable=False),
        sa.PrimaryKeyConstraint('id'),
        sa.UniqueConstraint('incident_id', 'key'),
    )
    op.create_index('ix_incident_action_items_incident_id', 'incident_action_items', ['incident_id'])


def downgrade() -> None:
    for table in ('incident_action_items', 'incident_notifications', 'escalations', 'incident_entries', 'incidents'):
        op.drop_table(table)

"""ci_records: a delivery, its pipeline run and its deployment are one record with a state that advances

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-28 05:30:00

``ci_deliveries``, ``ci_runs`` and ``deployments`` become one table, ``ci_records``
(apiary.store.models.CiRecord). The upgrade copies what the old tables hold: each delivery is a
record; a pipeline run joins the delivery whose started flow run it is (a pull request's
pipeline), else it is a record of its own; a deployment joins the record whose delivery started
its flow run (a push's deploy flow) or whose pipeline ran in that flow run, else it is a record of
its own. The downgrade splits the records back into the three tables.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op

revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None

#: Old delivery state -> record state, and back.
DELIVERY_STATES = {"accepted": "received", "pending": "pending", "failed": "not_started", "started": "started"}
RUN_STATES = {"running": "running", "success": "passed", "failure": "failed", "error": "failed"}
DEPLOY_STATES = {"succeeded": "deployed", "rolled_back": "rolled_back", "failed": "deploy_failed"}

_DELIVERIES = sa.table(
    'ci_deliveries', *(sa.column(c) for c in (
        'delivery', 'event', 'action', 'repo', 'pr_number', 'sha', 'ref', 'kind', 'state', 'flow_run_id',
        'reason', 'received_at', 'body_sha256')))
_RUNS = sa.table(
    'ci_runs', *(sa.column(c) for c in (
        'id', 'flow_run_id', 'repo', 'pr_number', 'sha', 'ref', 'kind', 'result', 'failed_stage', 'reason',
        'started_at', 'finished_at', 'duration_s', 'target_url')), sa.column('stages', sa.JSON()))
_DEPLOYS = sa.table(
    'deployments', *(sa.column(c) for c in (
        'id', 'sha', 'actor', 'trigger', 'started_at', 'finished_at', 'duration_s', 'result', 'reason',
        'flow_run_id')), *(sa.column(c, sa.JSON()) for c in ('images', 'previous_images', 'steps')))
_RECORD_COLUMNS = (
    'id', 'state', 'kind', 'repo', 'pr_number', 'sha', 'ref', 'delivery', 'event', 'action', 'received_at',
    'body_sha256', 'started_flow_run_id', 'delivery_reason', 'flow_run_id', 'result', 'failed_stage', 'reason',
    'started_at', 'finished_at', 'duration_s', 'target_url', 'deploy_flow_run_id', 'actor', 'trigger',
    'deploy_started_at', 'deploy_finished_at', 'deploy_duration_s', 'deploy_result', 'deploy_reason')
_RECORDS = sa.table('ci_records', *(sa.column(c) for c in _RECORD_COLUMNS),
                    *(sa.column(c, sa.JSON()) for c in ('stages', 'images', 'previous_images', 'steps')))


def _create_records() -> None:
    op.create_table(
        'ci_records',
        sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
        sa.Column('state', sa.String(length=16), nullable=False),
        sa.Column('kind', sa.String(length=16), nullable=False),
        sa.Column('repo', sa.String(length=200), nullable=True),
        sa.Column('pr_number', sa.Integer(), nullable=True),
        sa.Column('sha', sa.String(length=64), nullable=True),
        sa.Column('ref', sa.String(length=300), nullable=True),
        sa.Column('delivery', sa.String(length=64), nullable=True),
        sa.Column('event', sa.String(length=64), nullable=True),
        sa.Column('action', sa.String(length=64), nullable=True),
        sa.Column('received_at', sa.Float(), nullable=True),
        sa.Column('body_sha256', sa.String(length=64), nullable=True),
        sa.Column('started_flow_run_id', sa.String(length=64), nullable=True),
        sa.Column('delivery_reason', sa.Text(), nullable=False),
        sa.Column('flow_run_id', sa.String(length=64), nullable=True),
        sa.Column('result', sa.String(length=16), nullable=True),
        sa.Column('failed_stage', sa.String(length=100), nullable=True),
        sa.Column('reason', sa.Text(), nullable=True),
        sa.Column('started_at', sa.Float(), nullable=True),
        sa.Column('finished_at', sa.Float(), nullable=True),
        sa.Column('duration_s', sa.Float(), nullable=True),
        sa.Column('stages', sa.JSON(), nullable=False),
        sa.Column('target_url', sa.String(length=2048), nullable=True),
        sa.Column('deploy_flow_run_id', sa.String(length=64), nullable=True),
        sa.Column('images', sa.JSON(), nullable=True),
        sa.Column('previous_images', sa.JSON(), nullable=True),
        sa.Column('actor', sa.String(length=200), nullable=True),
        sa.Column('trigger', sa.String(length=16), nullable=True),
        sa.Column('deploy_started_at', sa.Float(), nullable=True),
        sa.Column('deploy_finished_at', sa.Float(), nullable=True),
        sa.Column('deploy_duration_s', sa.Float(), nullable=True),
        sa.Column('deploy_result', sa.String(length=16), nullable=True),
        sa.Column('deploy_reason', sa.Text(), nullable=True),
        sa.Column('steps', sa.JSON(), nullable=True),
        sa.PrimaryKeyConstraint('id'),
        sa.UniqueConstraint('delivery'),
        sa.UniqueConstraint('flow_run_id'),
        sa.UniqueConstraint('deploy_flow_run_id'),
    )
    op.create_index('ix_ci_records_state', 'ci_records', ['state'], unique=False)
    op.create_index('ix_ci_records_sha', 'ci_records', ['sha'], unique=False)
    op.create_index('ix_ci_records_received_at', 'ci_records', ['received_at'], unique=False)
    op.create_index('ix_ci_records_started_at', 'ci_records', ['started_at'], unique=False)
    op.create_index('ix_ci_records_deploy_started_at', 'ci_records', ['deploy_started_at'], unique=False)
    op.create_index('ux_ci_records_event_body', 'ci_records', ['event', 'body_sha256'], unique=True)


def _merged(conn: sa.Connection) -> list[dict[str, Any]]:
    """The records the old tables hold, in the order they were written."""
    records: list[dict[str, Any]] = []
    by_started: dict[str, dict[str, Any]] = {}  # a delivery's started flow run -> its record
    by_run: dict[str, dict[str, Any]] = {}  # a pipeline's flow run -> its record
    for d in conn.execute(sa.select(_DELIVERIES).order_by(_DELIVERIES.c.received_at)).mappings():
        rec = {"state": DELIVERY_STATES.get(d["state"], "received"), "kind": d["kind"], "repo": d["repo"],
               "pr_number": d["pr_number"], "sha": d["sha"], "ref": d["ref"], "delivery": d["delivery"],
               "event": d["event"], "action": d["action"], "received_at": d["received_at"],
               "body_sha256": d["body_sha256"], "started_flow_run_id": d["flow_run_id"],
               "delivery_reason": d["reason"] or "", "stages": []}
        records.append(rec)
        if d["flow_run_id"]:
            by_started.setdefault(d["flow_run_id"], rec)
    for r in conn.execute(sa.select(_RUNS).order_by(_RUNS.c.id)).mappings():
        run_rec = by_started.get(r["flow_run_id"])
        if run_rec is None or run_rec.get("flow_run_id") is not None:
            run_rec = {"kind": r["kind"], "repo": r["repo"], "pr_number": r["pr_number"], "sha": r["sha"],
                       "ref": r["ref"], "delivery_reason": ""}
            records.append(run_rec)
        run_rec.update(
            state=RUN_STATES.get(r["result"], "running"), flow_run_id=r["flow_run_id"], result=r["result"],
            failed_stage=r["failed_stage"], reason=r["reason"], started_at=r["started_at"],
            finished_at=r["finished_at"], duration_s=r["duration_s"], stages=r["stages"] or [],
            target_url=r["target_url"])
        by_run[r["flow_run_id"]] = run_rec
    for d in conn.execute(sa.select(_DEPLOYS).order_by(_DEPLOYS.c.id)).mappings():
        key = d["flow_run_id"]
        deploy_rec = (by_started.get(key) or by_run.get(key)) if key else None
        if deploy_rec is None or deploy_rec.get("deploy_result") is not None:
            deploy_rec = {"kind": "deploy", "sha": d["sha"], "delivery_reason": "", "stages": []}
            records.append(deploy_rec)
        deploy_rec.update(
            state=DEPLOY_STATES.get(d["result"], "deploy_failed"), deploy_flow_run_id=key, images=d["images"],
            previous_images=d["previous_images"], actor=d["actor"], trigger=d["trigger"],
            deploy_started_at=d["started_at"], deploy_finished_at=d["finished_at"],
            deploy_duration_s=d["duration_s"], deploy_result=d["result"], deploy_reason=d["reason"],
            steps=d["steps"] or [])
    return records


def upgrade() -> None:
    _create_records()
    conn = op.get_bind()
    rows = _merged(conn)
    if rows:
        full = [{c: r.get(c) for c in (*_RECORD_COLUMNS[1:], 'stages', 'images', 'previous_images', 'steps')}
                for r in rows]
        conn.execute(_RECORDS.insert(), full)
    op.drop_index('ux_ci_deliveries_event_body', table_name='ci_deliveries')
    op.drop_index('ix_ci_deliveries_received_at', table_name='ci_deliveries')
    op.drop_table('ci_deliveries')
    op.drop_index('ix_ci_runs_started_at', table_name='ci_runs')
    op.drop_table('ci_runs')
    op.drop_index('ix_deployments_started_at', table_name='deployments')
    op.drop_index('ix_deployments_sha', table_name='deployments')
    op.drop_table('deployments')


def downgrade() -> None:
    op.create_table(
        'ci_deliveries',
        sa.Column('delivery', sa.String(length=64), nullable=False),
        sa.Column('event', sa.String(length=64), nullable=False),
        sa.Column('action', sa.String(length=64), nullable=True),
        sa.Column('repo', sa.String(length=200), nullable=True),
        sa.Column('pr_number', sa.Integer(), nullable=True),
        sa.Column('sha', sa.String(length=64), nullable=True),
        sa.Column('ref', sa.String(length=300), nullable=True),
        sa.Column('kind', sa.String(length=16), nullable=False),
        sa.Column('state', sa.String(length=16), nullable=False),
        sa.Column('flow_run_id', sa.String(length=64), nullable=True),
        sa.Column('reason', sa.Text(), nullable=False),
        sa.Column('received_at', sa.Float(), nullable=False),
        sa.Column('body_sha256', sa.String(length=64), nullable=True),
        sa.PrimaryKeyConstraint('delivery'),
    )
    op.create_index('ix_ci_deliveries_received_at', 'ci_deliveries', ['received_at'], unique=False)
    op.create_index('ux_ci_deliveries_event_body', 'ci_deliveries', ['event', 'body_sha256'], unique=True)
    op.create_table(
        'ci_runs',
        sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
        sa.Column('flow_run_id', sa.String(length=64), nullable=False),
        sa.Column('repo', sa.String(length=200), nullable=False),
        sa.Column('pr_number', sa.Integer(), nullable=True),
        sa.Column('sha', sa.String(length=64), nullable=False),
        sa.Column('ref', sa.String(length=300), nullable=False),
        sa.Column('kind', sa.String(length=16), nullable=False),
        sa.Column('result', sa.String(length=16), nullable=False),
        sa.Column('failed_stage', sa.String(length=100), nullable=True),
        sa.Column('reason', sa.Text(), nullable=True),
        sa.Column('started_at', sa.Float(), nullable=False),
        sa.Column('finished_at', sa.Float(), nullable=True),
        sa.Column('duration_s', sa.Float(), nullable=True),
        sa.Column('stages', sa.JSON(), nullable=False),
        sa.Column('target_url', sa.String(length=2048), nullable=True),
        sa.PrimaryKeyConstraint('id'),
        sa.UniqueConstraint('flow_run_id'),
    )
    op.create_index('ix_ci_runs_started_at', 'ci_runs', ['started_at'], unique=False)
    op.create_table(
        'deployments',
        sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
        sa.Column('sha', sa.String(length=64), nullable=False),
        sa.Column('images', sa.JSON(), nullable=False),
        sa.Column('previous_images', sa.JSON(), nullable=True),
        sa.Column('actor', sa.String(length=200), nullable=False),
        sa.Column('trigger', sa.String(length=16), nullable=False),
        sa.Column('started_at', sa.Float(), nullable=False),
        sa.Column('finished_at', sa.Float(), nullable=False),
        sa.Column('duration_s', sa.Float(), nullable=False),
        sa.Column('result', sa.String(length=16), nullable=False),
        sa.Column('reason', sa.Text(), nullable=True),
        sa.Column('steps', sa.JSON(), nullable=False),
        sa.Column('flow_run_id', sa.String(length=64), nullable=True),
        sa.PrimaryKeyConstraint('id'),
        sa.UniqueConstraint('flow_run_id'),
    )
    op.create_index('ix_deployments_sha', 'deployments', ['sha'], unique=False)
    op.create_index('ix_deployments_started_at', 'deployments', ['started_at'], unique=False)
    conn = op.get_bind()
    back = {v: k for k, v in DELIVERY_STATES.items()}
    for r in conn.execute(sa.select(_RECORDS).order_by(_RECORDS.c.id)).mappings():
        if r["delivery"] is not None:
            conn.execute(_DELIVERIES.insert().values(
                delivery=r["delivery"], event=r["event"] or "", action=r["action"], repo=r["repo"],
                pr_number=r["pr_number"], sha=r["sha"], ref=r["ref"], kind=r["kind"],
                state=back.get(r["state"], "started"), flow_run_id=r["started_flow_run_id"],
                reason=r["delivery_reason"] or "", received_at=r["received_at"] or 0.0, body_sha256=r["body_sha256"]))
        if r["result"] is not None:
            conn.execute(_RUNS.insert().values(
                flow_run_id=r["flow_run_id"] or f"record-{r['id']}", repo=r["repo"] or "", pr_number=r["pr_number"],
                sha=r["sha"] or "", ref=r["ref"] or "", kind=r["kind"], result=r["result"],
                failed_stage=r["failed_stage"], reason=r["reason"], started_at=r["started_at"] or 0.0,
                finished_at=r["finished_at"], duration_s=r["duration_s"], stages=r["stages"] or [],
                target_url=r["target_url"]))
        if r["deploy_result"] is not None:
            conn.execute(_DEPLOYS.insert().values(
                sha=r["sha"] or "", images=r["images"] or {}, previous_images=r["previous_images"],
                actor=r["actor"] or "", trigger=r["trigger"] or "manual", started_at=r["deploy_started_at"] or 0.0,
                finished_at=r["deploy_finished_at"] or 0.0, duration_s=r["deploy_duration_s"] or 0.0,
                result=r["deploy_result"], reason=r["deploy_reason"], steps=r["steps"] or [],
                flow_run_id=r["deploy_flow_run_id"]))
    op.drop_table('ci_records')

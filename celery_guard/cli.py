"""``celery -A proj guard ...``: the operator's commands, a Celery sub-command (click)."""

from __future__ import annotations

from typing import Any

import click
from celery.bin.base import CeleryCommand

from celery_guard.errors import GuardError
from celery_guard.install import install


@click.group(name="guard")
def guard() -> None:
    """celery_guard: idempotency store maintenance."""


@guard.command(cls=CeleryCommand, name="migrate")
@click.pass_context
def migrate(ctx: Any) -> None:
    """Create celery_guard's tables in the store when they are missing."""
    app = ctx.obj.app
    runtime = install(app)
    try:
        runtime.migrate()
    except GuardError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"celery_guard tables are ready in {runtime.config.safe_store_url()}")

"""``install(app)`` for a Django project, and the task class that is both guarded and Django's."""

from __future__ import annotations

import dataclasses

from celery import Celery
from celery.contrib.django.task import DjangoTask

from celery_guard.config import DEFAULT_STORE_URL, GuardConfig
from celery_guard.errors import ConfigurationError
from celery_guard.install import GuardRuntime, Integration
from celery_guard.install import install as install_core
from celery_guard.runtime import find_runtime
from celery_guard.task import GuardedTask

from .database import DEFAULT_ALIAS, AtomicBlocks, store_url

#: The integration's name on a runtime (``GuardRuntime.integration.name``).
NAME = "Django"


class GuardedDjangoTask(GuardedTask, DjangoTask):  # type: ignore[misc]  # celery is untyped
    """:class:`~celery_guard.GuardedTask` with Celery's ``DjangoTask``: ``delay_on_commit()``
    and ``apply_async_on_commit()`` publish once the caller's transaction has committed (and not
    at all if it rolls back), and the worker deduplicates as for any guarded task.

    Make it the app's task class (``Celery("proj", task_cls=...)``, what Celery's Django fixup
    does with ``DjangoTask``) or a task's ``base``.
    """


class _DjangoStore:
    """Builds the Django integration of one app: the store on the alias's database."""

    def __init__(self) -> None:
        self.atomic = AtomicBlocks()

    def configure(self, config: GuardConfig) -> GuardConfig:
        if config.store_url != DEFAULT_STORE_URL:
            raise ConfigurationError(
                "CELERY_GUARD_STORE_URL is set, but with celery_guard.contrib.django the store "
                "lives on Django's database (CELERY_GUARD_DATABASE, by default 'default'): "
                "remove the URL, or name the alias instead"
            )
        alias = config.database or DEFAULT_ALIAS
        self.atomic.alias = alias
        return dataclasses.replace(config, store_url=store_url(alias), database=alias)


def install(app: Celery) -> GuardRuntime:
    """:func:`celery_guard.install` for a Django project: the store on Django's database.

    The store's tables come from ``python manage.py migrate`` (``guard_create_tables`` is off
    unless the settings turn it on), its connection from ``DATABASES[CELERY_GUARD_DATABASE]``
    (``"default"`` unless set), and ``self.guard.atomic()`` is ``transaction.atomic`` on that
    alias, committing with the key's COMPLETED marker. Calling it again returns the runtime
    already installed. See docs/django.md.
    """
    existing = find_runtime(app)
    if (
        isinstance(existing, GuardRuntime)
        and existing.integration is not None
        and existing.integration.name == NAME
    ):
        return existing
    django_store = _DjangoStore()
    integration = Integration(
        name=NAME,
        # Django's migrations own the schema (celery_guard/contrib/django/migrations).
        defaults={"create_tables": False},
        configure=django_store.configure,
        atomic=django_store.atomic,
    )
    return install_core(app, integration)

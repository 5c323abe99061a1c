"""What a task body may do with the transaction of ``self.guard.transaction()``.

The transaction commits once, with the key's COMPLETED marker, when the body returns. Whatever
the body does with its connection — commit it, roll it back, close it, hand it to an ORM
``Session`` that does — a key ends with at most one committed effect, or with a clear
:class:`TransactionMisuse` and nothing committed. Eager calls on SQLite and PostgreSQL; the same
patterns on real workers are in tests/acceptance/test_body_transaction.py.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import String, func, insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import celery_guard
from celery_guard import GuardedTask, TransactionMisuse


class Base(DeclarativeBase):
    pass


class Note(Base):
    __tablename__ = "notes"
    id: Mapped[int] = mapped_column(primary_key=True)
    tag: Mapped[str] = mapped_column(String(64))
    label: Mapped[str | None] = mapped_column(String(64), unique=True)


tables = Base.metadata
notes = Note.__table__


@pytest.fixture
def app(store_url: str) -> Iterator[Celery]:
    celery_app = Celery("body_transaction", broker="memory://", set_as_current=False)
    celery_app.conf.update(
        guard_store_url=store_url,
        task_always_eager=True,
        task_eager_propagates=True,
        guard_metrics_port=None,
    )
    runtime = celery_guard.install(celery_app)
    runtime.migrate()
    tables.create_all(runtime.store.engine)
    try:
        yield celery_app
    finally:
        runtime.store.dispose()


def rows(app: Celery, tag: str) -> int:
    with celery_guard.get_runtime(app).store.engine.connect() as connection:
        return int(
            connection.execute(
                select(func.count()).select_from(notes).where(notes.c.tag == tag)
            ).scalar_one()
        )


def state(app: Celery, key: str) -> tuple[str, int]:
    record = celery_guard.get_runtime(app).store.keys.get(key)
    assert record is not None
    return record.state, record.attempts


def guarded(app: Celery, body: Callable[[Any, str], Any]) -> Any:
    return app.task(base=GuardedTask, bind=True, shared=False, idempotency_key="k:{tag}")(body)


def assert_refused(app: Celery, body: Callable[[Any, str], Any]) -> None:
    """The body's attempt is refused: nothing commits, and the key is dead after one run."""
    task = guarded(app, body)
    tag = uuid.uuid4().hex
    with pytest.raises(TransactionMisuse):
        task.delay(tag)
    assert rows(app, tag) == 0
    assert state(app, f"k:{tag}") == ("DEAD", 1)


def write(connection: Any, tag: str, label: str | None = None) -> None:
    connection.execute(insert(notes).values(tag=tag, label=label))


def test_commit_inside_the_transaction_is_refused_and_nothing_commits(app: Celery) -> None:
    def body(self: Any, tag: str) -> None:
        with self.guard.transaction() as connection:
            write(connection, tag)
            connection.commit()

    task = guarded(app, body)
    tag = uuid.uuid4().hex
    with pytest.raises(TransactionMisuse, match=r"tried to commit .* remove the commit\(\)"):
        task.delay(tag)
    assert rows(app, tag) == 0
    # A programming error: dead-lettered after one execution, never re-run.
    assert state(app, f"k:{tag}") == ("DEAD", 1)


@pytest.mark.parametrize("ending", ["rollback", "close"])
def test_rollback_or_close_is_refused_and_later_writes_do_not_commit(
    app: Celery, ending: str
) -> None:
    caught: list[BaseException] = []

    def body(self: Any, tag: str) -> str:
        with self.guard.transaction() as connection:
            write(connection, tag)
            try:
                getattr(connection, ending)()
            except TransactionMisuse as exc:  # a body that swallows the refusal
                caught.append(exc)
            write(connection, tag)
        return "done"

    task = guarded(app, body)
    tag = uuid.uuid4().hex
    with pytest.raises(TransactionMisuse, match=r"begin_nested"):
        task.delay(tag)
    assert len(caught) == 1
    assert rows(app, tag) == 0
    assert state(app, f"k:{tag}") == ("DEAD", 1)


def test_an_orm_session_in_control_fully_mode_cannot_commit(app: Celery) -> None:
    def body(self: Any, tag: str) -> None:
        with self.guard.transaction() as connection:
            session = Session(bind=connection, join_transaction_mode="control_fully")
            session.add(Note(tag=tag))
            session.commit()

    assert_refused(app, body)


def test_a_default_session_rollback_is_refused(app: Celery) -> None:
    def body(self: Any, tag: str) -> None:
        with self.guard.transaction() as connection:
            session = Session(bind=connection)
            session.add(Note(tag=tag))
            session.flush()
            session.rollback()

    assert_refused(app, body)


def test_a_savepoint_undoes_its_part_only(app: Celery) -> None:
    def body(self: Any, tag: str) -> int:
        with self.guard.transaction() as connection:
            write(connection, tag, label=f"{tag}-a")
            with connection.begin_nested():
                write(connection, tag, label=f"{tag}-b")
            try:
                with connection.begin_nested():
                    write(connection, tag, label=f"{tag}-a")  # a duplicate label
            except IntegrityError:
                pass
        return 2

    task = guarded(app, body)
    tag = uuid.uuid4().hex
    assert task.delay(tag).get() == 2
    assert task.delay(tag).get() == 2  # the duplicate delivery runs nothing
    assert rows(app, tag) == 2
    assert state(app, f"k:{tag}") == ("COMPLETED", 1)


def test_guard_session_commits_with_the_marker(app: Celery) -> None:
    def body(self: Any, tag: str) -> list[str | None]:
        with self.guard.session() as session:
            session.add(Note(tag=tag, label=f"{tag}-kept"))
            session.commit()  # releases the session's savepoint: still one commit per key
            session.add(Note(tag=tag, label=f"{tag}-undone"))
            session.flush()
            session.rollback()  # back to the savepoint: only the second note goes
            kept = session.scalars(select(Note).where(Note.tag == tag)).all()
            session.add(Note(tag=tag, label=f"{tag}-uncommitted"))  # committed on exit
        return sorted(note.label for note in kept)

    task = guarded(app, body)
    tag = uuid.uuid4().hex
    assert task.delay(tag).get() == [f"{tag}-kept"]
    assert task.delay(tag).get() == [f"{tag}-kept"]
    assert rows(app, tag) == 2
    assert state(app, f"k:{tag}") == ("COMPLETED", 1)


def test_guard_session_writes_roll_back_when_the_body_fails(app: Celery) -> None:
    def body(self: Any, tag: str) -> None:
        with self.guard.session() as session:
            session.add(Note(tag=tag))
            session.commit()
            raise ValueError("order has no lines")

    task = guarded(app, body)
    tag = uuid.uuid4().hex
    with pytest.raises(ValueError, match="no lines"):
        task.delay(tag)
    assert rows(app, tag) == 0
    assert state(app, f"k:{tag}") == ("DEAD", 1)


def test_a_caught_failed_statement_is_named_not_retried(app: Celery, store_url: str) -> None:
    """PostgreSQL aborts the transaction after a failed statement even if the body catches it."""

    def body(self: Any, tag: str) -> None:
        with self.guard.transaction() as connection:
            write(connection, tag, label=tag)
            with contextlib.suppress(IntegrityError):
                write(connection, tag, label=tag)

    task = guarded(app, body)
    tag = uuid.uuid4().hex
    if store_url.startswith("sqlite"):
        # SQLite keeps the transaction usable: the first row commits with the marker.
        task.delay(tag).get()
        assert rows(app, tag) == 1
        assert state(app, f"k:{tag}") == ("COMPLETED", 1)
        return
    with pytest.raises(TransactionMisuse, match="savepoint"):
        task.delay(tag)
    assert rows(app, tag) == 0
    assert state(app, f"k:{tag}") == ("DEAD", 1)

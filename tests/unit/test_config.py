"""GuardConfig: how settings are spelled, and every bad value failing at first use, named."""

from __future__ import annotations

import pytest
from celery import Celery

import celery_guard
from celery_guard import ConfigurationError, GuardConfig


def make_app(**conf: object) -> Celery:
    app = Celery("config_test", broker="memory://", set_as_current=False)
    app.conf.update(conf)
    return app


def test_defaults_use_embedded_sqlite() -> None:
    config = GuardConfig.from_celery_conf(make_app().conf)
    assert config.store_url == "sqlite:///celery_guard.sqlite3"
    assert config.lease_ttl == 10.0
    assert config.result_ttl == 7 * 24 * 3600.0
    assert config.create_tables is True


def test_postgresql_urls_are_pinned_to_psycopg3() -> None:
    for url in ("postgresql://u:p@127.0.0.1/db", "postgres://u:p@127.0.0.1/db"):
        config = GuardConfig(store_url=url)
        assert config.store_url.startswith("postgresql+psycopg://")


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("guard_store_url", "mysql://u@127.0.0.1/db", "guard_store_url scheme 'mysql'"),
        ("guard_store_url", "postgresql+psycopg2://u@127.0.0.1/db", "psycopg 3"),
        ("guard_store_url", "not a url", "guard_store_url is not a database URL"),
        ("guard_store_url", 42, "guard_store_url must be a URL string"),
        ("guard_store_url", "postgresql://u@h:port/db", "guard_store_url is not a database URL"),
        ("guard_lease_ttl", "10", "guard_lease_ttl must be a number"),
        ("guard_lease_ttl", 0, "guard_lease_ttl must be a finite number >= 0.1"),
        ("guard_store_timeout", float("nan"), "guard_store_timeout must be a finite number"),
        ("guard_result_ttl", -1, "guard_result_ttl must be a finite number >= 0.0"),
        ("guard_result_ttl", True, "guard_result_ttl must be a number"),
        ("guard_create_tables", "yes", "guard_create_tables must be True or False"),
        ("guard_lease_tll", 5, "unknown celery_guard setting 'guard_lease_tll'; did you mean"),
        ("guard_max_payload_bytes", 100, "guard_max_payload_bytes must be a number of bytes"),
        ("guard_max_payload_bytes", "16MB", "guard_max_payload_bytes must be a number of bytes"),
        ("guard_track_publishes", "yes", "guard_track_publishes must be True or False, got 'yes'"),
        ("guard_track_publishes", 1, "guard_track_publishes must be True or False, got 1"),
        (
            "guard_unclaimed_republish_after",
            0,
            "guard_unclaimed_republish_after must be a finite number of seconds > 0, got 0",
        ),
        (
            "guard_unclaimed_republish_after",
            -5.0,
            "guard_unclaimed_republish_after must be a finite number of seconds > 0",
        ),
        (
            "guard_unclaimed_republish_after",
            "5m",
            "guard_unclaimed_republish_after must be a number of seconds, got '5m'",
        ),
        ("guard_unclaimed_republish_after", None, "guard_unclaimed_republish_after must be a"),
        ("guard_track_publish", True, "did you mean 'guard_track_publishes'"),
    ],
)
def test_bad_values_fail_at_first_use_naming_the_key(key: str, value: object, message: str) -> None:
    app = make_app(**{key: value})
    runtime = celery_guard.install(app)  # reads no setting: the app may not be configured yet
    pattern = message.replace("(", r"\(").replace("+", r"\+")
    with pytest.raises(ConfigurationError, match=pattern):
        _ = runtime.config
    with pytest.raises(ConfigurationError, match=pattern):  # and again: never half-built
        _ = celery_guard.get_runtime(app).store
    with pytest.raises(ConfigurationError, match=pattern):  # a producer's first publish
        app.send_task("config_test.anything")


def test_publish_tracking_is_off_by_default_and_waits_five_minutes() -> None:
    config = GuardConfig.from_celery_conf(make_app().conf)
    assert config.track_publishes is False
    assert config.unclaimed_republish_after == 300.0
    on = GuardConfig.from_celery_conf(
        make_app(guard_track_publishes=True, guard_unclaimed_republish_after=0.5).conf
    )
    assert (on.track_publishes, on.unclaimed_republish_after) == (True, 0.5)


def test_result_ttl_none_keeps_results_until_pruned() -> None:
    config = GuardConfig.from_celery_conf(make_app(guard_result_ttl=None).conf)
    assert config.result_ttl is None


def test_safe_store_url_hides_the_password() -> None:
    config = GuardConfig(store_url="postgresql://shop:s3cret@127.0.0.1/shop")
    assert "s3cret" not in config.safe_store_url()
    assert "***" in config.safe_store_url()


def test_install_is_idempotent_per_app() -> None:
    app = make_app()
    assert celery_guard.install(app) is celery_guard.install(app)


def test_circuit_and_adaptive_concurrency_defaults() -> None:
    config = GuardConfig.from_celery_conf(make_app().conf)
    assert config.circuit_enabled is True
    assert config.circuit_failure_ratio == 0.5
    assert config.circuit_min_calls == 5
    assert config.circuit_window == 10.0
    assert config.circuit_probe_interval == 1.0
    assert config.circuit_hold == 5.0
    assert config.adaptive_concurrency is True
    assert config.adaptive_timeout_ratio == 0.2
    assert config.adaptive_latency is None


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("guard_circuit_enabled", "on", "guard_circuit_enabled must be True or False"),
        ("guard_circuit_failure_ratio", 0, "guard_circuit_failure_ratio must be a number > 0"),
        ("guard_circuit_failure_ratio", 1.5, "guard_circuit_failure_ratio must be a number > 0"),
        ("guard_circuit_failure_ratio", "half", "guard_circuit_failure_ratio must be a number"),
        ("guard_circuit_min_calls", 0, "guard_circuit_min_calls must be an integer >= 1"),
        ("guard_circuit_min_calls", 2.5, "guard_circuit_min_calls must be an integer >= 1"),
        ("guard_circuit_min_calls", True, "guard_circuit_min_calls must be an integer >= 1"),
        ("guard_circuit_window", 0, "guard_circuit_window must be a finite number >= 0.1"),
        ("guard_circuit_probe_interval", None, "guard_circuit_probe_interval must be a number"),
        ("guard_circuit_hold", -1, "guard_circuit_hold must be a finite number >= 0.0"),
        ("guard_adaptive_concurrency", 1, "guard_adaptive_concurrency must be True or False"),
        ("guard_adaptive_timeout_ratio", float("nan"), "guard_adaptive_timeout_ratio must be"),
        ("guard_adaptive_latency", 0, "guard_adaptive_latency must be a finite number >= 0.001"),
        ("guard_circuit_treshold", 0.5, "unknown celery_guard setting 'guard_circuit_treshold'"),
    ],
)
def test_bad_circuit_values_fail_at_first_use_naming_the_key(
    key: str, value: object, message: str
) -> None:
    app = make_app(**{key: value})
    with pytest.raises(ConfigurationError, match=message):
        celery_guard.install(app).load()


def test_passwords_never_show_in_reprs_errors_or_celerys_config_views() -> None:
    config = GuardConfig(
        store_url="postgresql://shop:s3cret@127.0.0.1/shop", lease_url="redis://:s3cret@h:1/0"
    )
    assert "s3cret" not in repr(config) and "shop:***@" in repr(config)
    with pytest.raises(ConfigurationError) as caught:
        GuardConfig(lease_url="redis//:s3cret@127.0.0.1:1/0")  # malformed: no "://"
    assert "s3cret" not in str(caught.value) and ":***@127.0.0.1" in str(caught.value)
    app = make_app(
        guard_store_url="postgresql://shop:s3cret@127.0.0.1/shop",
        guard_lease_url="redis://:s3cret@127.0.0.1:1/0",
    )
    celery_guard.install(app)
    # What `celery inspect conf`, `celery report` and Flower show.
    table = app.conf.table(with_defaults=False)
    assert table["guard_store_url"] == table["guard_lease_url"] == "********"
    assert "s3cret" not in app.conf.humanize(with_defaults=False)


# -- spellings: Celery's namespace, upper case, both orders of install and configuration -------


class DjangoSettings:
    """What ``config_from_object("django.conf:settings", namespace="CELERY")`` reads."""

    DEBUG = False
    INSTALLED_APPS = ("shop",)
    CELERY_BROKER_URL = "memory://"
    CELERY_GUARD_STORE_URL = "postgresql://shop:s3cret@127.0.0.1/shop"
    CELERY_GUARD_LEASE_TTL = 5


def settings(**extra: object) -> type:
    return type("Settings", (DjangoSettings,), extra)


def namespaced_app(obj: object, *, install_first: bool) -> Celery:
    app = Celery("config_test", set_as_current=False)
    if install_first:
        celery_guard.install(app)
        app.config_from_object(obj, namespace="CELERY")
    else:
        app.config_from_object(obj, namespace="CELERY")
        celery_guard.install(app)
    return app


@pytest.mark.parametrize("install_first", [True, False], ids=["install-first", "configure-first"])
def test_namespaced_settings_are_read_in_either_order(install_first: bool) -> None:
    app = namespaced_app(settings(), install_first=install_first)
    config = celery_guard.get_runtime(app).config
    assert config.store_url == "postgresql+psycopg://shop:s3cret@127.0.0.1/shop"
    assert config.lease_ttl == 5
    assert app.conf.broker_url == "memory://"  # Celery reads its own keys the same way


def test_settings_changed_after_install_are_the_ones_used() -> None:
    app = make_app(guard_lease_ttl=3)
    runtime = celery_guard.install(app)
    app.conf.guard_lease_ttl = 4
    assert runtime.config.lease_ttl == 4


@pytest.mark.parametrize("install_first", [True, False], ids=["install-first", "configure-first"])
def test_a_misspelled_namespaced_setting_is_refused_at_first_publish(install_first: bool) -> None:
    app = namespaced_app(settings(CELERY_GUARD_LEASE_TLL=5), install_first=install_first)
    message = (
        "unknown celery_guard setting 'CELERY_GUARD_LEASE_TLL'; "
        "did you mean 'CELERY_GUARD_LEASE_TTL'?"
    )
    with pytest.raises(ConfigurationError) as caught:
        app.send_task("config_test.anything")
    assert str(caught.value) == message
    with pytest.raises(ConfigurationError, match="CELERY_GUARD_LEASE_TTL"):
        _ = celery_guard.get_runtime(app).config


def test_the_namespace_from_celerys_constructor_and_in_lower_case() -> None:
    upper = Celery("config_test", set_as_current=False, namespace="CELERY")
    upper.conf.update(CELERY_GUARD_LEASE_TTL=6)
    assert GuardConfig.from_celery_conf(upper.conf).lease_ttl == 6
    lower = Celery("config_test", set_as_current=False, namespace="celery")
    lower.conf.update(celery_guard_lease_ttl=7, celery_guard_reaper_intervall=1)
    with pytest.raises(ConfigurationError, match="did you mean 'celery_guard_reaper_interval'"):
        GuardConfig.from_celery_conf(lower.conf)


def test_plain_keys_are_read_under_a_namespace_but_not_against_a_namespaced_one() -> None:
    agreeing = namespaced_app(
        settings(guard_lease_ttl=5, guard_reaper_interval=1.5), install_first=True
    )
    config = celery_guard.get_runtime(agreeing).config
    assert (config.lease_ttl, config.reaper_interval) == (5, 1.5)
    clashing = namespaced_app(
        settings(guard_store_url="sqlite:///other.sqlite3"), install_first=True
    )
    with pytest.raises(ConfigurationError) as caught:
        _ = celery_guard.get_runtime(clashing).config
    assert str(caught.value) == (
        "celery_guard setting 'store_url' is set twice, as 'CELERY_GUARD_STORE_URL' and "
        "'guard_store_url', with different values; keep one, 'CELERY_GUARD_STORE_URL' under "
        "the app's namespace"
    )


def test_a_bad_namespaced_value_is_named_as_the_config_spells_it() -> None:
    app = namespaced_app(settings(CELERY_GUARD_LEASE_TTL="ten"), install_first=True)
    with pytest.raises(ConfigurationError) as caught:
        _ = celery_guard.get_runtime(app).config
    assert str(caught.value) == "CELERY_GUARD_LEASE_TTL must be a number of seconds, got 'ten'"
    renewal = namespaced_app(settings(CELERY_GUARD_LEASE_RENEW_INTERVAL=9), install_first=True)
    with pytest.raises(ConfigurationError) as caught:
        _ = celery_guard.get_runtime(renewal).config
    assert str(caught.value).startswith(
        "CELERY_GUARD_LEASE_RENEW_INTERVAL (9) must be shorter than CELERY_GUARD_LEASE_TTL (5)"
    )


def test_namespaced_keys_without_a_namespace_are_refused_not_ignored() -> None:
    app = Celery("config_test", set_as_current=False)
    app.config_from_object(settings())  # namespace="CELERY" forgotten
    with pytest.raises(ConfigurationError) as caught:
        GuardConfig.from_celery_conf(app.conf)
    assert "is not read: the app has no namespace" in str(caught.value)
    assert "namespace='CELERY'" in str(caught.value)


def test_upper_case_keys_without_a_namespace() -> None:
    config = GuardConfig.from_celery_conf(make_app(GUARD_LEASE_TTL=3).conf)
    assert config.lease_ttl == 3
    with pytest.raises(ConfigurationError, match="did you mean 'GUARD_LEASE_TTL'"):
        GuardConfig.from_celery_conf(make_app(GUARD_LEASE_TLL=3).conf)
    with pytest.raises(ConfigurationError, match="set twice, as 'GUARD_LEASE_TTL' and 'guard_"):
        GuardConfig.from_celery_conf(make_app(GUARD_LEASE_TTL=3, guard_lease_ttl=4).conf)


def test_namespaced_urls_are_masked_in_celerys_config_views() -> None:
    app = namespaced_app(settings(), install_first=True)
    table = app.conf.table(with_defaults=False)
    assert table["CELERY_GUARD_STORE_URL"] == "********"
    assert "s3cret" not in app.conf.humanize(with_defaults=False)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"store_pooling": "statement"}, "guard_store_pooling must be one of 'session', "),
        ({"store_pooling": None}, "guard_store_pooling must be one of"),
        ({"store_pooling": "transaction"}, "is for a PostgreSQL store behind a transaction"),
        ({"liveness_url": "postgresql://db/x"}, "guard_liveness_url is for a PostgreSQL store"),
    ],
)
def test_pooling_settings_on_sqlite_or_unknown_are_refused(
    settings: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        GuardConfig(**settings)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("liveness_url", "message"),
    [
        ("sqlite:///x.db", "guard_liveness_url must be a postgresql:// URL"),
        ("mysql://u@db/x", "guard_liveness_url scheme 'mysql' is not supported"),
        ("not a url", "guard_liveness_url is not a database URL"),
        (5432, "guard_liveness_url must be a URL string"),
    ],
)
def test_a_liveness_url_must_be_postgresql(liveness_url: object, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        GuardConfig(
            store_url="postgresql://u@pgbouncer:6432/shop",
            store_pooling="transaction",
            liveness_url=liveness_url,  # type: ignore[arg-type]
        )


def test_a_liveness_url_without_liveness_locks_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="guard_liveness_locks is False"):
        GuardConfig(
            store_url="postgresql://u@pgbouncer:6432/shop",
            liveness_locks=False,
            liveness_url="postgresql://u@db:5432/shop",
        )


def test_transaction_pooling_with_a_direct_liveness_url() -> None:
    config = GuardConfig.from_celery_conf(
        {
            "guard_store_url": "postgresql://u:secret@pgbouncer:6432/shop",
            "guard_store_pooling": "transaction",
            "guard_liveness_url": "postgres://u:hidden@db:5432/shop",
        }
    )
    assert config.store_pooling == "transaction"
    assert config.liveness_url == "postgresql+psycopg://u:hidden@db:5432/shop"
    assert "hidden" not in repr(config) and "secret" not in repr(config)
    assert GuardConfig().store_pooling == "session" and GuardConfig().liveness_url is None


def test_a_bad_pooling_value_is_named_as_the_config_spells_it() -> None:
    with pytest.raises(ConfigurationError, match="CELERY_GUARD_STORE_POOLING must be one of"):
        GuardConfig.from_celery_conf(
            {
                "CELERY_GUARD_STORE_URL": "postgresql://u@pgbouncer:6432/shop",
                "CELERY_GUARD_STORE_POOLING": "Transaction",
            },
            namespace="CELERY",
        )

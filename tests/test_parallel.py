"""Each xdist worker gets its own database, Redis database, data and metrics directories (support/parallel.py)."""

from __future__ import annotations

import os

import pytest

from tests.support import parallel


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for name in (
        "PYTEST_XDIST_WORKER",
        parallel.ISOLATED_FOR,
        "DATABASE_URL",
        "REDIS_URL",
        "GENSERVER_DATA_DIR",
        "PROMETHEUS_MULTIPROC_DIR",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GENSERVER_DATA_DIR", str(tmp_path))
    return monkeypatch


def test_outside_xdist_nothing_changes(clean_env, tmp_path):
    clean_env.setenv("REDIS_URL", "redis://127.0.0.1:6379/0")
    parallel.isolate_worker_environment()
    assert os.environ["REDIS_URL"] == "redis://127.0.0.1:6379/0"
    assert os.environ["GENSERVER_DATA_DIR"] == str(tmp_path)


def test_each_worker_takes_the_next_redis_database_and_a_data_directory_of_its_own(clean_env, tmp_path):
    clean_env.setenv("REDIS_URL", "redis://127.0.0.1:6379/3")
    clean_env.setenv("DATABASE_URL", f"sqlite:///{tmp_path / 'db.sqlite3'}")  # SQLite: unchanged (its own data dir)
    clean_env.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "prometheus"))  # the controller's metrics import
    clean_env.setenv("PYTEST_XDIST_WORKER", "gw1")
    parallel.isolate_worker_environment()
    assert os.environ["REDIS_URL"] == "redis://127.0.0.1:6379/5"
    assert os.environ["GENSERVER_DATA_DIR"] == str(tmp_path / "gw1") and (tmp_path / "gw1").is_dir()
    assert os.environ["PROMETHEUS_MULTIPROC_DIR"] == str(tmp_path / "prometheus" / "gw1")
    assert os.environ["DATABASE_URL"] == f"sqlite:///{tmp_path / 'db.sqlite3'}"
    # A process the worker starts (its stack's) imports the test settings again: nothing moves twice.
    parallel.isolate_worker_environment()
    assert os.environ["REDIS_URL"] == "redis://127.0.0.1:6379/5"
    assert os.environ["GENSERVER_DATA_DIR"] == str(tmp_path / "gw1")
    assert os.environ["PROMETHEUS_MULTIPROC_DIR"] == str(tmp_path / "prometheus" / "gw1")


@pytest.mark.skipif(parallel.worker_id() is None, reason="only an xdist worker has a neighbour to share with")
def test_this_workers_metrics_files_are_its_own():
    # The controller's Django setup imported genserver.metrics, which set the directory in the environment every
    # worker inherits; a shared one let the other worker's submits move this one's counters (test_scrape.py).
    from genserver import metrics

    assert metrics.MULTIPROCESS_DIR.name == parallel.worker_id(), metrics.MULTIPROCESS_DIR
    assert os.environ["PROMETHEUS_MULTIPROC_DIR"] == str(metrics.MULTIPROCESS_DIR)


def test_a_redis_database_past_the_last_is_refused_with_what_to_change(clean_env):
    clean_env.setenv("REDIS_URL", "redis://127.0.0.1:6379/14")
    clean_env.setenv("PYTEST_XDIST_WORKER", "gw1")
    with pytest.raises(RuntimeError, match="use a lower database or fewer PYTEST_WORKERS"):
        parallel.isolate_worker_environment()


@pytest.mark.skipif(
    not os.environ.get("DATABASE_URL", "").startswith("postgres"), reason="a worker's database is made on PostgreSQL"
)
def test_on_postgresql_a_worker_gets_its_own_database_created_once(clean_env):
    import psycopg
    from psycopg import sql

    base = _configured_postgres_url()
    name = psycopg.conninfo.conninfo_to_dict(base)["dbname"]
    worker = "gwselftest"
    clean_env.setenv("DATABASE_URL", base)
    clean_env.setenv("PYTEST_XDIST_WORKER", worker)
    try:
        parallel.isolate_worker_environment()
        assert os.environ["DATABASE_URL"].endswith(f"/{name}_{worker}")
        clean_env.delenv(parallel.ISOLATED_FOR)
        clean_env.setenv("DATABASE_URL", base)
        parallel.isolate_worker_environment()  # again (an interrupted run's database is there): the same answer
        with psycopg.connect(os.environ["DATABASE_URL"]) as conn:
            assert conn.execute("SELECT current_database()").fetchone()[0] == f"{name}_{worker}"
    finally:
        with psycopg.connect(base, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(f"{name}_{worker}")))


def _configured_postgres_url() -> str:
    """The session's DATABASE_URL (under xdist already this worker's: any database on the server will do)."""
    from django.conf import settings

    db = settings.DATABASES["default"]
    return f"postgres://{db['USER']}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"

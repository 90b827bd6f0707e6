"""The floor under `queue/`: what talks to PostgreSQL below Django's public API.

- `hooks`: Django's connections and cursors (a thread's connections, health checks,
  atomic blocks a task left open, the worker's kept cursor and its loaders);
- `direct`: the enqueue's INSERT straight on libpq, named on the session.

Only `queue/` imports this package (pyproject.toml's import-linter contracts); every
module names what it relies on, and `tests/db/test_compat.py` has a test for each.
"""

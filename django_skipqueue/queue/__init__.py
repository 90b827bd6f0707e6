"""Every statement that reads or writes the queue's tables: the managers' verbs (claim,
enqueue, outcomes, reap, operator actions), the raw SQL, loading claimed rows, and the
per-transaction session bounds. The models are `django_skipqueue.models`, beside it.

This layer never sleeps or starts a thread; every other layer changes rows only
through its verbs (docs/explanation/architecture.md).
"""

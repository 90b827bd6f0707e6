"""The task API: `Task`, the `@task` decorator, `TaskContext` and the registry.

Above the queue layer: a task enqueues through the job manager (its one port down), and
the queue layer never imports `Task` (docs/explanation/architecture.md).
"""

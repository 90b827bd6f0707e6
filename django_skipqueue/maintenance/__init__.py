"""Work on the table that is not running jobs: the reaper (expired leases, pruning)
and the scheduler (periodic schedules). Run by the worker's helper threads and by
management commands (docs/explanation/architecture.md).
"""

"""The worker process: the dispatcher, the in-flight book, the executor (run a job and
decide its outcome), the housekeeper (renewals, heartbeats, reaps), LISTEN/NOTIFY, flow
control's view, thread supervision, the process pool and stop signals
(docs/explanation/architecture.md).
"""

"""Signals about jobs. Sent only by executor.py and reaper.py; sender is the Job class.

- job_started(job): an attempt is about to run.
- job_succeeded(job, result, duration): the attempt returned and its ack was accepted.
- job_retried(job, error, run_after): the attempt failed; the job will run again.
- job_failed(job, error, exception): the job ended failed (last attempt, or a
  non-retryable error); `exception` is what the attempt raised (None from the reaper).
- job_released(job, delay): the attempt was given back by the task (Retry). A graceful
  stop's releases are logged, not signalled.
- job_lost(job): the attempt had lost its lease; its outcome was refused by the fence.
- job_outcome_unknown(job): the outcome could not be written (no answer from the
  database within a lease); the reaper takes the job back if the write did not happen.
- job_reaped(requeued, failed, cancelled, expired): the reaper took back expired leases
  (and ended `expired` jobs not started by their expires_at).

Sent by tasks/durable.py, for a durable job's steps (sender: the Job class as well):

- step_recorded(job_id, task, name, kind): a step ran and its record was written (for
  an atomic step: committed).
- step_replayed(job_id, task, name, kind): a later attempt got a step's recorded result
  instead of running it.
"""

from __future__ import annotations

from django.dispatch import Signal

job_started = Signal()
job_succeeded = Signal()
job_retried = Signal()
job_failed = Signal()
job_released = Signal()
job_lost = Signal()
job_outcome_unknown = Signal()
job_reaped = Signal()
step_recorded = Signal()
step_replayed = Signal()

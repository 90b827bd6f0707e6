"""factory_boy factories for jobs in every state, relative to the database clock."""

from __future__ import annotations

from datetime import timedelta

import factory
from django.db.models.functions import Now

from django_skipqueue.models import Job, JobState

#: Rows per bulk_create() of built jobs. With Django's `server_side_binding` option
#: (which .ci/run's matrix runs the suite with) a statement takes at most 65,535
#: parameters, and Django 5.2's bulk_create does not split its batches for that: 2,000
#: jobs of 35 columns would be 70,000.
BULK_BATCH = 1000


class JobFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Job

    task = "tests.testapp.tasks.add"
    args = factory.LazyFunction(lambda: [1, 2])
    kwargs = factory.LazyFunction(dict)
    queue_name = "default"
    lease = timedelta(minutes=5)
    max_attempts = 5

    class Params:
        running = factory.Trait(
            state=JobState.RUNNING,
            attempts=1,
            started_at=factory.LazyFunction(Now),
            leased_until=factory.LazyFunction(lambda: Now() + timedelta(minutes=5)),
        )
        expired = factory.Trait(
            state=JobState.RUNNING,
            attempts=1,
            started_at=factory.LazyFunction(lambda: Now() - timedelta(minutes=10)),
            leased_until=factory.LazyFunction(lambda: Now() - timedelta(minutes=5)),
        )
        failed = factory.Trait(
            state=JobState.FAILED,
            attempts=5,
            last_error="RuntimeError: boom",
            finished_at=factory.LazyFunction(Now),
        )
        done = factory.Trait(
            state=JobState.DONE,
            attempts=1,
            finished_at=factory.LazyFunction(Now),
        )

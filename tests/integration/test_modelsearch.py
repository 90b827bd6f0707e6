"""A real library on the Tasks API: modelsearch (Wagtail's search, extracted) declares
its index update with the django-tasks backport's @task and enqueues it on post_save.
Under SkipQueueBackend that is a job in the saving transaction, run by our worker.

On Django 5.2 the backport is the API our backend serves; on 6.x, django.tasks is, and
the backport's handler creates our backend from the same TASKS (core/tasks_api.py).
"""

from __future__ import annotations

import pytest

pytest.importorskip("modelsearch", reason="modelsearch is not installed")
pytest.importorskip("django_skipqueue.core.tasks_api", reason="no Tasks API installed")

from django.db import transaction  # noqa: E402
from modelsearch.backends import get_search_backend  # noqa: E402
from modelsearch.models import IndexEntry  # noqa: E402

from django_skipqueue.models import Job, JobState  # noqa: E402
from django_skipqueue.testing import run_jobs  # noqa: E402
from tests.searchapp.models import Article  # noqa: E402

pytestmark = pytest.mark.django_db(transaction=True)

INDEX_TASK = "modelsearch.tasks.insert_or_update_object_task"


def test_a_save_enqueues_the_index_update_that_our_worker_runs():
    article = Article.objects.create(title="Claiming jobs with skip locked")

    [job] = Job.objects.filter(task=INDEX_TASK)
    assert (job.args, job.state) == (["searchapp", "article", str(article.pk)], JobState.PENDING)
    assert not IndexEntry.objects.exists()  # nothing is indexed until a worker runs it

    [execution] = run_jobs()

    assert execution.job_id == job.id
    job.refresh_from_db()
    assert job.state == JobState.DONE
    assert IndexEntry.objects.filter(object_id=str(article.pk)).count() == 1
    found = get_search_backend().search("skip locked", Article)
    assert list(found) == [article]


def test_a_rolled_back_save_leaves_no_index_update():
    with pytest.raises(RuntimeError), transaction.atomic():
        Article.objects.create(title="Never saved")
        raise RuntimeError
    assert not Job.objects.filter(task=INDEX_TASK).exists()
    assert run_jobs() == []

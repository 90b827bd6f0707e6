"""The example's own test of a django.tasks task: green under ImmediateBackend and ours.

TASKS_BACKEND=django.tasks.backends.immediate.ImmediateBackend pytest -c pytest.ini
pytest -c pytest.ini   # django_skipqueue.backends.SkipQueueBackend
"""

import pytest

pytest.importorskip("django.tasks", reason="django.tasks needs Django 6.0 or newer")

from django.tasks import TaskResultStatus  # noqa: E402

from django_skipqueue.testing import run_jobs  # noqa: E402
from shop.django_tasks import order_shipped_notice  # noqa: E402


@pytest.mark.django_db(transaction=True)
def test_the_shipping_notice_task_succeeds():
    result = order_shipped_notice.enqueue(7)
    run_jobs()  # runs queued jobs; with ImmediateBackend the task already ran
    if result.task.get_backend().supports_get_result:
        result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == "order 7 shipped"

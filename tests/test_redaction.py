from __future__ import annotations

import logging

import pytest

from django_skipqueue.redaction import redact, redact_text


def test_secret_keys_are_masked_at_any_depth():
    data = {"user": 7, "password": "hunter2", "nested": [{"Stripe_API_Key": "sk_live"}]}
    assert redact(data) == {"user": 7, "password": "***", "nested": [{"Stripe_API_Key": "***"}]}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("postgres://app:s3cret@db:5432/x", "postgres://app:***@db:5432/x"),
        ("retry with token=abc123 please", "retry with token=*** please"),
        ('{"password": "hunter2", "id": 4}', '{"password": ***, "id": 4}'),
        ("Authorization: Bearer-xyz", "Authorization: ***"),
        ("nothing secret here", "nothing secret here"),
    ],
)
def test_secrets_in_text_are_masked(text, expected):
    assert redact_text(text) == expected


def test_the_keys_come_from_settings(settings):
    settings.SKIPQUEUE = {"REDACT_KEYS": ["pin"]}
    assert redact({"pin": "1234", "password": "visible"}) == {"pin": "***", "password": "visible"}


@pytest.mark.django_db(transaction=True)
def test_s8_a_stored_error_never_keeps_a_password_from_the_exception(caplog):
    caplog.set_level(logging.INFO, logger="django_skipqueue")
    from django_skipqueue.testing import run_jobs
    from tests.testapp import tasks

    job = tasks.leaks_a_secret.enqueue("postgres://app:s3cret@db/x")
    run_jobs()
    job.refresh_from_db()
    stored = job.last_error + str(job.errors)
    assert "s3cret" not in stored and "abc123" not in stored
    assert "postgres://app:***@db/x" in job.last_error
    assert "job raised" in caplog.text
    assert "s3cret" not in caplog.text and "abc123" not in caplog.text

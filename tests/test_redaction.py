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


#: Forms of secret seen in real errors and payloads: (text, the secret it must not show).
CORPUS = [
    ("Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.e30.sig", "eyJhbGciOiJIUzI1NiJ9"),
    ("authorization: bearer abc123def", "abc123def"),
    ("Authorization: Basic dXNlcjpwYXNzd29yZA==", "dXNlcjpwYXNzd29yZA"),
    ("headers={'Authorization': 'Token tok_9f8e7d'}", "tok_9f8e7d"),
    ('curl -H "Authorization: Bearer s3cr3t-b34r3r" https://api', "s3cr3t-b34r3r"),
    ("sent Bearer naked-token-123 to the API", "naked-token-123"),
    ("redis://:hunter2@cache:6379/0", "hunter2"),
    ("amqp://guest:rabbit-pw@127.0.0.1:5672/", "rabbit-pw"),
    ("postgresql://app:pg%40ss@db/x", "pg%40ss"),
    ("apiKey=AKIA1234", "AKIA1234"),
    ('{"apiKey": "AKIA5678"}', "AKIA5678"),
    ("x-api-key: xk-42-secret", "xk-42-secret"),
    ("X-API-KEY=XK-UPPER", "XK-UPPER"),
    ("passwd=letmein", "letmein"),
    ("db_password: 'quoted pass'", "quoted pass"),
    ('{"password": "ab\\"cd-tail"}', "cd-tail"),
    ("{'password': 'it\\'s-a-secret'}", "s-a-secret"),
    ("stripe_api_key=sk_live_123", "sk_live_123"),
    ("client_secret=cs_456&grant_type=x", "cs_456"),
    ('error in payload note="token=inner-tok"', "inner-tok"),
    ("privateKey=-----BEGIN", "-----BEGIN"),
    ("Cookie: sessionid=abcdef0123", "abcdef0123"),
]


@pytest.mark.parametrize(("text", "secret"), CORPUS, ids=[text[:30] for text, _ in CORPUS])
def test_every_form_in_the_corpus_is_masked(text, secret):
    masked = redact_text(text)
    assert secret not in masked
    assert "***" in masked


@pytest.mark.parametrize(
    "key", ["apiKey", "x-api-key", "X-Api-Key", "passwd", "db_password", "Private-Key", "cookie"]
)
def test_secret_key_names_in_data_are_masked_whatever_their_spelling(key):
    assert redact({key: "v", "id": 1}) == {key: "***", "id": 1}


@pytest.mark.parametrize(
    "text",
    [
        "job 42 failed: connection refused",
        "postgres://app@db:5432/x",  # a user name but no password
        "retry in 5s (attempt=2, queue=default)",
    ],
)
def test_text_without_a_secret_is_left_as_it_is(text):
    assert redact_text(text) == text


@pytest.mark.parametrize(
    ("key", "shown"),
    [
        ("invoice_id=5", "invoice_id=5"),
        ("order-42:2024-06-01", "order-42:2024-06-01"),
        ("recalculate-all-invoices", "recalculate-all-invoices"),
        ("reset:user:42:Zt9xQ2vLp8", "reset:user:42:***"),
        ("invite:550e8400-e29b-41d4-a716-446655440000", "invite:***"),
        ("card:4242424242424242", "card:***"),
        ("token=short", "token=***"),
    ],
)
def test_a_unique_key_keeps_words_numbers_and_dates_and_masks_what_may_be_a_token(key, shown):
    from django_skipqueue.redaction import redact_key

    assert redact_key(key) == shown

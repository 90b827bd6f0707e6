"""The test settings with DEBUG on, so that runserver serves the admin's static files."""

from tests.settings import *  # noqa: F403

DEBUG = True
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]

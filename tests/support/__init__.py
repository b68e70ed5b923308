"""Helpers the tests import (``from support.models import ...``); the fixtures are ``support.fixtures``."""

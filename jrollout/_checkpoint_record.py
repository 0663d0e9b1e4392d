"""Transitional: compat.py's import, until it reads _checkpoint.record."""

from jrollout._checkpoint.record import check_matches as check_matches

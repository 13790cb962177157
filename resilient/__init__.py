"""Rank side of resilient."""

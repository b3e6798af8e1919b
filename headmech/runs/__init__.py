"""Resumable runs and their provenance."""

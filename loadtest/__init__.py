"""Locust scenarios and P99 targets per hardware profile."""

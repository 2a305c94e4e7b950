"""Incident response: notification channels and their delivery (issue 14)."""

"""Incident response on the live platform: the incident service, its store and escalation worker, the
one action pipeline (cordon, drain, stop, tag, notify) and the notification channels."""

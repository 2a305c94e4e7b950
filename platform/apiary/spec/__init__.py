"""OpenPAI job protocol v2 and cluster configuration models."""

"""Hosts for multi-host tests and drills: Linux network namespaces on one bridge (:mod:`.netns`)."""

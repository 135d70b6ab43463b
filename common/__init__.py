"""Contracts shared by every service: settings, topics, message envelopes and the bus."""

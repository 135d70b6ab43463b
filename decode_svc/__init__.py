"""Decode worker: imports prefilled state and decodes every job it holds with continuous batching."""

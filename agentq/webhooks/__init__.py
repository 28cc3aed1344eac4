"""Signed webhooks when a turn ends (Standard Webhooks), delivered at least once."""

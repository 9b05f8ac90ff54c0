"""Kubernetes adapters: an async REST client, vramshare's resources on the wire, the reservation ledger."""

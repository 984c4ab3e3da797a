"""Specula launcher: starts the model shards and the router and supervises them (`specula-launcher`)."""

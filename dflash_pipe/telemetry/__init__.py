"""Telemetry: metrics sinks, timing spans and the live dashboard."""

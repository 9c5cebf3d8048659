"""Monitoring: progress and summaries now; step breakdown, stragglers and exporters build on them."""

"""Fault tolerance: checkpoints now; recovery, watchdog and injection build on them."""

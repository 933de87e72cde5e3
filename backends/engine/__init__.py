"""The embedded engine core: wire request, scheduler, prefix cache, per-session accounting."""

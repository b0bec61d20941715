"""The speculative engine: paged KV, scheduler, spec step, verification, embedded Engine."""

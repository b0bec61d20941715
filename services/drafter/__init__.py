"""The drafter actor: DFlash KV injection and block forwards behind the step protocol."""

"""dflash-serve: DFlash speculative decoding as a service."""

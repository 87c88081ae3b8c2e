"""The one definition of the engine -> HTTP wire format, its transports and readers (no paddle here)."""

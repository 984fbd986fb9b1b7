"""Every way of computing a checked attention forward."""

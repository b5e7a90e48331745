"""Types that both the coordinator (mesh/) and the stages (stage/) speak: neither owns them."""

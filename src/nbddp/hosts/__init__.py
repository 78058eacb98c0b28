"""A host's own processes under torchrun: the relay (one per host, its ranks speak to the
notebook through it) and the holder (one per rank, it forks the rank again when it
dies)."""

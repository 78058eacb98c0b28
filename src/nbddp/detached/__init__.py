"""Detached pools: the pool core in a process of its own (the server) that outlives its
kernel, and a kernel's side of it (client, proxy), over one authenticated connection."""

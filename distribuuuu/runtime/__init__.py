"""The distributed runtime: the processes, their group, and what stops them.

- ``launcher``: which launcher started this process and its device (pure: no process group).
- ``process_group``: rendezvous with a fast start-up check, collectives, rank helpers.
- ``heartbeat``: per-rank heartbeats that name stopped ranks before a collective times out.
- ``preemption``: SIGTERM/SIGUSR1 and Ctrl-C become a checkpoint, an exit code and a requeue.
- ``faults``: failed or timed-out collectives named, non-finite losses.
- ``parallel``: FSDP2 sharding: the device mesh, the blocks, mixed precision.
"""

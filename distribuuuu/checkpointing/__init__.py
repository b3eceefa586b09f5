"""Checkpoint files and folders, knowing nothing of a run: ``training`` says what goes in them.

- ``checkpoint``: the one front door to either format (a file or a ``.dcp`` folder): save, load,
  verify, find the newest good one, prune.
- ``single_file``: one atomic, checksummed file written by rank 0; safe loads.
- ``sharded``: DCP folders, one shard per rank, with a manifest; converted to and from one file.
- ``names``: the checkpoints folder: names, their one order, listing, stale temporaries.
- ``background_write``: writes in a background thread, one in flight, its error at the next wait.
- ``stored_config``: the config a checkpoint's run stored, read back for the tools.
- ``average``: the last or best N checkpoints of an OUT_DIR averaged into one.
"""

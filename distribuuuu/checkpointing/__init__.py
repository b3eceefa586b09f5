"""Checkpoint files and folders, knowing nothing of a run: the caller hands in what goes in them.

- ``manager``: the Checkpointer, a run's checkpoints in one place: save (now or in the background),
  prune, find the one to resume, load.
- ``formats``: what a checkpoint is made of (``Component``) and the two formats (``SingleFile``,
  ``Sharded``) that lay the components out; a third is one more ``Format``.
- ``checkpoint``: the one front door to either format as the tools take it (a file or a ``.dcp``
  folder): save, load, verify, find the newest good one, prune.
- ``single_file``: one atomic, checksummed file written by rank 0; safe loads.
- ``sharded``: DCP folders, one shard per rank, with a manifest; read whole into one dict.
- ``dcp_reader``, ``file_kind``: a ``.metadata`` read by a restricted unpickler; a file that is no
  checkpoint named as what it is.
- ``names``: the checkpoints folder: names, their one order, listing, stale temporaries.
- ``background_write``: writes in a background thread, one in flight, its error at the next wait.
- ``average``: the last or best N checkpoints of an OUT_DIR averaged into one.
"""

"""What a run measures and writes down in its OUT_DIR.

- ``writer``: the metrics writer (log line, metrics.jsonl, TensorBoard, trackers, summary at the end).
- ``meters``: top-k counts and exact metric sums across ranks.
- ``multilabel``: multi-label mAP, F1, precision and recall from counts exact across ranks.
- ``eval_outputs``: confusion matrices, per-class accuracy and predictions files.
- ``metrics_file``: metrics.jsonl on disk: the one reader, and the repair of a torn last line.
- ``summary``: the run summary of an OUT_DIR (end of training and tools/summarize.py).
- ``plots``: the metrics plot (tools/plot_metrics.py).
- ``tracking``: W&B and MLflow, rank 0 only, never fatal.
- ``manifest``: the merged config and the code, versions and machines of each start.
- ``out_dir_lock``: one run per OUT_DIR, a lock file naming its holder.
"""

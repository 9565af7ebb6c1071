"""The run skeleton every algorithm shares.

A run directory holds the resolved config, metrics (JSONL and TensorBoard), checkpoints, a plot and a summary;
a run resumes from its latest complete checkpoint and stops on Ctrl-C at its loop's next safe point. An algorithm
supplies only its step loop and its math:

- ``log``: ``RunLog`` (config snapshot, metrics.jsonl, TensorBoard, progress line, notes) and the summary;
- ``checkpoints``: ``CheckpointStore`` (numbered checkpoints, complete or not, latest, pruning);
- ``resume``: the saved config with overrides, refusing changes a checkpoint cannot follow;
- ``progress``: the terminal lines (step of total, rate, ETA) and what goes to TensorBoard;
- ``plots``: learning curves;
- ``interrupts``: Ctrl-C as a stop request.
"""

"""Checkpoints: the Hugging Face folder format (``hf_format``), what a step or epoch folder holds and how it is
written (``checkpointer``, in the background: ``async_save``; each state file with its checksum: ``state_file``), the
run folder and its lock (``run_folder``, ``lock``), and resume (``resume``; the saved optimizer state's values:
``state_check``, its format and conversions: ``optimizer_state``)."""

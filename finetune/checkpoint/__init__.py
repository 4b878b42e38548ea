"""Checkpoints: the Hugging Face folder format (``hf_format``), what a step or epoch folder holds and how it is
written (``checkpointer``, in the background: ``async_save``), the run folder and its lock (``run_folder``, ``lock``),
and resume (``resume``)."""

"""What a run reports: metrics records and the summary (``metrics``), wandb (``wandb_run``), the profiler
(``profiler``), and what the terminal shows (``console``)."""

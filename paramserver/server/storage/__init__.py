"""A shard's persistence, one module per concept: the log record format (`log_format`), the
log file (`log_file`), checkpoint files (`checkpoint_file`) and their content
(`checkpoint_content`), recovery (`recovery`) and the running data directory
(`data_dir`)."""

"""`make demo`'s parts that are not orchestration: figures per setup (report), plots (figures)."""

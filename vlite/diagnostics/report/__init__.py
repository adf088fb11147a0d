"""How the leak checker tells it: the terminal verdict and tables, and the report directory,
written by one writer (``writer.write_report_dir``) for every target."""

"""What the leak checker sends: request specs from a synthetic, trace or ShareGPT source
(``sources``), each request's client action (``actions``), the default every-path workload
(``all_paths``) and the stop-token calibration (``calibrate``)."""

"""Prometheus metrics, the metrics window, `lmserve diagnose`'s rules, the step trace."""

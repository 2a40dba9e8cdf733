"""Autotuned kernel configs, <device>/<kernel>.json, read at launch time."""

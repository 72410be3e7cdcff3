"""Checkpoint file formats, one reader each, below both `memory/` (the plan reads headers before anything
loads) and `models/` (the loader reads the tensors). No torch: what reads only headers stays cheap to import.
"""

"""MoEvement fault tolerance: sparse checkpointing, conversion and localized recovery.

This package knows operators (named groups of tensors) and tensors, never model classes.
"""

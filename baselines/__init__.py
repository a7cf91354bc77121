"""The compared checkpointing strategies (Gemini, CheckFreq, MoC-System): interval policies, MoC's
partial expert checkpointing, and the global rollback they recover with."""

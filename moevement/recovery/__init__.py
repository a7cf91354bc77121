"""Recovery from persisted sparse checkpoints: localized recovery of failed stages (fetch, convert by
replay, catch up from upstream logs) and whole-job restart."""
